package report

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"
)

// palette of the series (colour-blind friendly, Okabe–Ito).
var palette = []string{"#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442"}

// BarChart is a grouped bar chart: one group per label, one bar per series.
type BarChart struct {
	Title  string
	Unit   string
	Groups []string
	Series []string
	// Values[g][s] is series s of group g; NaN draws no bar.
	Values [][]float64
}

// WriteSVG draws the chart as a standalone SVG document.
func (c BarChart) WriteSVG(w io.Writer) error {
	const (
		width, height            = 720, 360
		left, right, top, bottom = 70, 20, 40, 70
	)
	plotW, plotH := float64(width-left-right), float64(height-top-bottom)
	top0 := 0.0
	for _, row := range c.Values {
		for _, v := range row {
			if !math.IsNaN(v) && !math.IsInf(v, 0) {
				top0 = max(top0, v)
			}
		}
	}
	scaleMax := niceCeil(top0)
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="15" font-weight="bold">%s</text>`+"\n", left, html.EscapeString(c.Title))
	// Axis and gridlines at fifths of the scale.
	for i := 0; i <= 5; i++ {
		v := scaleMax * float64(i) / 5
		y := float64(top) + plotH - plotH*float64(i)/5
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", left, y, width-right, y)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", left-6, y+4, html.EscapeString(trimNum(v)))
	}
	fmt.Fprintf(&b, `<text x="14" y="%d" transform="rotate(-90 14 %d)" text-anchor="middle">%s</text>`+"\n", top+int(plotH/2), top+int(plotH/2), html.EscapeString(c.Unit))
	ng, ns := len(c.Groups), max(len(c.Series), 1)
	if ng > 0 {
		gw := plotW / float64(ng)
		bw := gw * 0.8 / float64(ns)
		for g := range c.Groups {
			x0 := float64(left) + gw*float64(g) + gw*0.1
			for s := 0; s < ns && g < len(c.Values) && s < len(c.Values[g]); s++ {
				v := c.Values[g][s]
				if math.IsNaN(v) || math.IsInf(v, 0) || scaleMax == 0 {
					continue
				}
				h := plotH * max(v, 0) / scaleMax
				x := x0 + bw*float64(s)
				y := float64(top) + plotH - h
				fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s</title></rect>`+"\n",
					x, y, bw*0.92, h, palette[s%len(palette)], html.EscapeString(fmt.Sprintf("%s %s: %s %s", c.Groups[g], seriesName(c.Series, s), trimNum(v), c.Unit)))
				fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="10">%s</text>`+"\n", x+bw*0.46, y-3, html.EscapeString(trimNum(v)))
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", x0+gw*0.4, top+int(plotH)+18, html.EscapeString(c.Groups[g]))
		}
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, top+int(plotH), width-right, top+int(plotH))
	// Legend.
	for s, name := range c.Series {
		x := left + s*130
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/>`+"\n", x, height-24, palette[s%len(palette)])
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", x+16, height-14, html.EscapeString(name))
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func seriesName(series []string, s int) string {
	if s < len(series) {
		return series[s]
	}
	return ""
}

// niceCeil rounds up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func trimNum(v float64) string {
	switch {
	case v == math.Trunc(v) && math.Abs(v) < 1e9:
		return fmt.Sprintf("%.0f", v)
	case math.Abs(v) >= 100:
		return fmt.Sprintf("%.0f", v)
	case math.Abs(v) >= 1:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.3f", v)
}

// HitRateChart is a bar chart of each strategy's hit rate (and, when
// bounds are known, the bound as a second series) per workload.
func HitRateChart(sums []Summary, bound float64) BarChart {
	c := BarChart{Title: "KV-cache hit rate by strategy", Unit: "hit rate (cached / prompt tokens)", Series: []string{"hit rate"}}
	if bound > 0 {
		c.Series = append(c.Series, "pooled-cache bound")
	}
	for _, s := range sums {
		c.Groups = append(c.Groups, label(s))
		row := []float64{s.HitRate}
		if bound > 0 {
			row = append(row, bound)
		}
		c.Values = append(c.Values, row)
	}
	return c
}

// TTFTChart is a grouped bar chart of TTFT p50/p90/p99 per strategy.
func TTFTChart(sums []Summary) BarChart {
	c := BarChart{Title: "Time to first token by strategy", Unit: "TTFT (ms)", Series: []string{"p50", "p90", "p99"}}
	for _, s := range sums {
		c.Groups = append(c.Groups, label(s))
		c.Values = append(c.Values, []float64{s.TTFTP50Ms, s.TTFTP90Ms, s.TTFTP99Ms})
	}
	return c
}

func label(s Summary) string { return s.Strategy }
