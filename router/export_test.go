package router

// LimitTokenizeForTest exposes limitTokenize to the external tests.
var LimitTokenizeForTest = limitTokenize
