package bench

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// fioResult is what the harness keeps of one fio run.
type fioResult struct {
	Bytes     int64   // bytes read plus written in the measured time
	IOPS      float64 // read plus write
	BW        float64 // bytes per second, read plus write
	LatMeanUs float64 // mean completion latency of the busier direction
	LatP50Us  float64 // median completion latency, same direction
	LatP99Us  float64 // 99th percentile completion latency, same direction
	LatP999Us float64 // 99.9th percentile, same direction
	LatMaxUs  float64 // the slowest request, same direction
	// WriteP999Us and WriteMaxUs are the writes' 99.9th percentile and
	// slowest completion latency (0 when nothing was written).
	WriteP999Us float64
	WriteMaxUs  float64
	ClientCPU   float64 // fio's own usr+sys CPU, percent of one CPU
	RuntimeSec  float64 // measured time fio reports
}

type fioOutput struct {
	Version string   `json:"fio version"`
	Jobs    []fioJob `json:"jobs"`
}

type fioJob struct {
	Name   string  `json:"jobname"`
	Error  int     `json:"error"`
	Read   fioDir  `json:"read"`
	Write  fioDir  `json:"write"`
	UsrCPU float64 `json:"usr_cpu"`
	SysCPU float64 `json:"sys_cpu"`
}

type fioDir struct {
	IOBytes  int64   `json:"io_bytes"`
	IOPS     float64 `json:"iops"`
	Runtime  int64   `json:"runtime"` // milliseconds
	TotalIOs int64   `json:"total_ios"`
	ClatNs   struct {
		Mean       float64            `json:"mean"`
		Max        float64            `json:"max"`
		Percentile map[string]float64 `json:"percentile"`
	} `json:"clat_ns"`
}

// parseFioJSON parses fio's --output-format=json output. fio may print
// notes ("fio: connected to NBD server") before the JSON document, so
// anything before the first '{' is skipped.
func parseFioJSON(data []byte) (fioResult, error) {
	start := bytes.IndexByte(data, '{')
	if start < 0 {
		return fioResult{}, errors.New("fio output: no JSON object")
	}
	var out fioOutput
	if err := json.Unmarshal(data[start:], &out); err != nil {
		return fioResult{}, fmt.Errorf("fio output: %w", err)
	}
	if len(out.Jobs) == 0 {
		return fioResult{}, errors.New("fio output: no jobs")
	}
	var r fioResult
	var busiest fioDir
	var runtimeMs int64
	for _, j := range out.Jobs {
		if j.Error != 0 {
			return fioResult{}, fmt.Errorf("fio job %q: error %d", j.Name, j.Error)
		}
		for _, d := range []fioDir{j.Read, j.Write} {
			r.Bytes += d.IOBytes
			r.IOPS += d.IOPS
			runtimeMs = max(runtimeMs, d.Runtime)
			if d.TotalIOs > busiest.TotalIOs {
				busiest = d
			}
		}
		r.ClientCPU += j.UsrCPU + j.SysCPU
		if j.Write.TotalIOs > 0 {
			// Of several jobs, the worst.
			r.WriteP999Us = max(r.WriteP999Us, j.Write.ClatNs.Percentile["99.900000"]/1000)
			r.WriteMaxUs = max(r.WriteMaxUs, j.Write.ClatNs.Max/1000)
		}
	}
	if r.Bytes == 0 || runtimeMs == 0 {
		return fioResult{}, errors.New("fio output: no I/O was measured")
	}
	r.RuntimeSec = float64(runtimeMs) / 1000
	r.BW = float64(r.Bytes) / r.RuntimeSec
	r.LatMeanUs = busiest.ClatNs.Mean / 1000
	r.LatP50Us = busiest.ClatNs.Percentile["50.000000"] / 1000
	r.LatP99Us = busiest.ClatNs.Percentile["99.000000"] / 1000
	r.LatP999Us = busiest.ClatNs.Percentile["99.900000"] / 1000
	r.LatMaxUs = busiest.ClatNs.Max / 1000
	return r, nil
}
