//go:build !linux

package devicetest

func addFileOpeners(map[string]Opener) {}
