package model

import (
	"flag"
	"os"
	"strings"
	"testing"
	"testing/synctest"
)

var (
	calibrate     = flag.Bool("calibrate", false, "TestCalibration: measure the default models in virtual time and print the table")
	calibrateReal = flag.Bool("calibrate-real", false, "TestCalibration: measure the default models on the real clock (about 2 minutes)")
)

// TestCalibration runs the calibration table. Without flags it is a smoke
// test of Calibrate (short runs, virtual time). To print the table:
//
//	go test ./device/model -run TestCalibration -calibrate -v       # virtual time, exact model figures
//	go test ./device/model -run TestCalibration -calibrate-real -v  # real clock, as a client sees them
func TestCalibration(t *testing.T) {
	switch {
	case *calibrateReal:
		// Shorter runs: the real clock is slow, and the fsync'd random
		// writes run at ~80 a second.
		rows, err := Calibrate(os.Stdout, CalibrationOptions{Seconds: 3, FragWrites: 400})
		if err != nil {
			t.Fatal(err)
		}
		checkRows(t, rows)
	case *calibrate:
		synctest.Test(t, func(t *testing.T) {
			rows, err := Calibrate(os.Stdout, CalibrationOptions{virtual: true})
			if err != nil {
				t.Fatal(err)
			}
			checkRows(t, rows)
		})
	default:
		synctest.Test(t, func(t *testing.T) {
			var b strings.Builder
			rows, err := Calibrate(&b, CalibrationOptions{virtual: true, Seconds: 0.05, FragWrites: 10, Only: []string{KindHDD, KindSSD}})
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) != 22 || !strings.Contains(b.String(), "rand read 4K QD32") {
				t.Errorf("calibration printed %d rows:\n%s", len(rows), b.String())
			}
		})
	}
}

func checkRows(t *testing.T, rows []CalibrationRow) {
	for _, r := range rows {
		if r.Value <= 0 {
			t.Errorf("%s %s: %v %s", r.Model, r.Test, r.Value, r.Metric)
		}
	}
}
