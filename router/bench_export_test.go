package router

// ProcessCPUForTest exposes processCPU to the external benchmarks.
var ProcessCPUForTest = processCPU
