package bench

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"time"
)

// userHZ is the unit of the utime and stime fields of /proc/PID/stat. The
// kernel exports them in USER_HZ, which is 100 on every architecture Go
// supports on Linux (only alpha and ia64 differ).
const userHZ = 100

// parseProcStatCPU returns the utime and stime fields (in clock ticks) of the
// contents of a /proc/PID/stat file. The command name (field 2) is in
// parentheses and may itself contain spaces and parentheses, so the fields
// are counted from the last ')'.
func parseProcStatCPU(data []byte) (utime, stime uint64, err error) {
	end := bytes.LastIndexByte(data, ')')
	if end < 0 {
		return 0, 0, fmt.Errorf("proc stat: no ')' after the command name in %q", truncate(data, 80))
	}
	// After ')' come field 3 (state) onwards; utime and stime are fields
	// 14 and 15, so indexes 11 and 12 here.
	fields := bytes.Fields(data[end+1:])
	if len(fields) < 13 {
		return 0, 0, fmt.Errorf("proc stat: %d fields after the command name, want at least 13", len(fields))
	}
	utime, err = strconv.ParseUint(string(fields[11]), 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("proc stat: utime: %w", err)
	}
	stime, err = strconv.ParseUint(string(fields[12]), 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("proc stat: stime: %w", err)
	}
	return utime, stime, nil
}

// processCPU returns the user plus system CPU time used so far by all
// threads of process pid.
func processCPU(pid int) (time.Duration, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("read cpu time of pid %d: %w", pid, err)
	}
	u, s, err := parseProcStatCPU(data)
	if err != nil {
		return 0, fmt.Errorf("pid %d: %w", pid, err)
	}
	return ticksToDuration(u + s), nil
}

func ticksToDuration(ticks uint64) time.Duration {
	return time.Duration(ticks) * (time.Second / userHZ)
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}

// parseSystemCPU returns the busy and total clock ticks of all CPUs from
// the contents of /proc/stat (its first, "cpu", line). Busy is everything
// but idle and iowait; guest time is already inside user and nice.
func parseSystemCPU(data []byte) (busy, total uint64, err error) {
	line, _, _ := bytes.Cut(data, []byte("\n"))
	fields := bytes.Fields(line)
	if len(fields) < 8 || string(fields[0]) != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat: first line %q is not the cpu total", truncate(line, 80))
	}
	// user nice system idle iowait irq softirq [steal [guest [guest_nice]]]
	for i, f := range fields[1:min(len(fields), 9)] {
		v, err := strconv.ParseUint(string(f), 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/stat: cpu field %d: %w", i+1, err)
		}
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total, nil
}

// systemBusy returns the CPU time all CPUs spent busy so far.
func systemBusy() (time.Duration, error) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("read machine cpu time: %w", err)
	}
	busy, _, err := parseSystemCPU(data)
	if err != nil {
		return 0, err
	}
	return ticksToDuration(busy), nil
}
