package bench

import (
	"fmt"
	"image/color"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// serverColors keeps a server's colour the same in every chart.
var serverColors = map[string]color.Color{
	"tiercache": color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	"qemu-nbd":  color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	"nbdkit":    color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
}

// chartFiles are the PNGs writeCharts produces, for publishing.
var chartFiles = []string{"iops.png", "bandwidth.png", "cpu-4k.png", "cpu-1m.png"}

// writeCharts draws grouped bar charts (one group per workload, one bar per
// server) of median throughput and of server CPU per GiB into dir.
func writeCharts(dir string, s summary) error {
	var iops, bw []Workload
	for _, w := range Workloads {
		if w.Metric == MetricIOPS {
			iops = append(iops, w)
		} else {
			bw = append(bw, w)
		}
	}
	sub := fmt.Sprintf("median of %d round(s)", s.rounds)
	charts := []struct {
		file, title, ylabel string
		ws                  []Workload
		m                   map[key]stat
	}{
		{"iops.png", "4 KiB random I/O over NBD, " + sub + " (higher is better)", "IOPS", iops, s.perf},
		{"bandwidth.png", "1 MiB sequential I/O over NBD, " + sub + " (higher is better)", "MiB/s", bw, s.perf},
		// CPU per GiB is ten times higher for 4 KiB requests than for
		// 1 MiB ones; one axis would flatten the 1 MiB bars.
		{"cpu-4k.png", "Server CPU per GiB moved, 4 KiB random, " + sub + " (lower is better)", "CPU seconds / GiB", iops, s.cpu},
		{"cpu-1m.png", "Server CPU per GiB moved, 1 MiB sequential, " + sub + " (lower is better)", "CPU seconds / GiB", bw, s.cpu},
	}
	for _, c := range charts {
		if err := barChart(filepath.Join(dir, c.file), c.title, c.ylabel, c.ws, s.servers, c.m); err != nil {
			return fmt.Errorf("chart %s: %w", c.file, err)
		}
	}
	return nil
}

func barChart(path, title, ylabel string, ws []Workload, servers []string, m map[key]stat) error {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = ylabel
	p.Y.Min = 0
	p.Legend.Top = true
	p.Legend.XOffs = -vg.Points(12)
	names := make([]string, len(ws))
	for i, w := range ws {
		names[i] = w.Name
	}
	barWidth := vg.Points(22)
	n := len(servers)
	top := 0.0
	for i, srv := range servers {
		vals := make(plotter.Values, len(ws))
		for j, w := range ws {
			if st := m[key{srv, w.Name}]; st.ok {
				vals[j] = st.med
				top = max(top, st.med)
			}
		}
		bars, err := plotter.NewBarChart(vals, barWidth)
		if err != nil {
			return err
		}
		bars.LineStyle.Width = 0
		bars.Color = serverColors[srv]
		bars.Offset = barWidth * vg.Length(float64(i)-float64(n-1)/2)
		p.Add(bars)
		p.Legend.Add(srv, bars)
	}
	p.NominalX(names...)
	if top > 0 {
		p.Y.Max = top * 1.25 // room for the legend above the bars
	}
	width := vg.Length(len(ws)) * max(vg.Length(n)*barWidth*1.5, 1.6*vg.Inch)
	c := vgimg.NewWith(vgimg.UseWH(max(width+vg.Inch, 7*vg.Inch), 4*vg.Inch), vgimg.UseDPI(110))
	p.Draw(draw.New(c))
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
