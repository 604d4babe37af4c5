package kvm

import (
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// libIndex maps a shared library's file name (its soname, as binaries name
// it in DT_NEEDED) to its path relative to the unpacked packages' root.
type libIndex map[string]string

// indexLibs finds every shared library under the unpacked packages.
func indexLibs(pkgRoot string) (libIndex, error) {
	idx := libIndex{}
	err := filepath.WalkDir(pkgRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() || !strings.Contains(name, ".so") {
			return nil
		}
		rel, _ := filepath.Rel(pkgRoot, p)
		if !strings.Contains(rel, "lib") || strings.Contains(rel, "/modules/") {
			return nil
		}
		if old, ok := idx[name]; !ok || len(rel) < len(old) {
			idx[name] = rel
		}
		return nil
	})
	return idx, err
}

// neededClosure returns the shared libraries (paths relative to the package
// root) the ELF files need, transitively, and the program interpreter. A
// library none of the unpacked packages holds is an error naming it: the
// guest would fail to run the binary, so the image is not built.
func neededClosure(pkgRoot string, idx libIndex, files []string) ([]string, error) {
	seen := map[string]bool{}
	var out []string
	var missing []string
	queue := append([]string(nil), files...)
	for len(queue) > 0 {
		rel := queue[0]
		queue = queue[1:]
		real, err := resolveIn(pkgRoot, rel)
		if err != nil {
			return nil, err
		}
		f, err := elf.Open(real)
		if err != nil {
			var fe *elf.FormatError
			if errors.As(err, &fe) {
				continue // a script, not an ELF file
			}
			return nil, err
		}
		libs, err := f.ImportedLibraries()
		if err != nil && !errors.Is(err, elf.ErrNoSymbols) {
			f.Close()
			return nil, fmt.Errorf("%s: %w", rel, err)
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				b := make([]byte, p.Filesz)
				if _, err := p.ReadAt(b, 0); err == nil {
					libs = append(libs, filepath.Base(strings.TrimRight(string(b), "\x00")))
				}
			}
		}
		f.Close()
		for _, lib := range libs {
			if seen[lib] {
				continue
			}
			seen[lib] = true
			p, ok := idx[lib]
			if !ok {
				missing = append(missing, fmt.Sprintf("%s (needed by %s)", lib, rel))
				continue
			}
			out = append(out, p)
			queue = append(queue, p)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("no guest package holds %s: add its package to guestPackages", strings.Join(missing, ", "))
	}
	return out, nil
}

// moduleDepends reads a kernel module's "depends=" from its .modinfo
// section: the modules it needs loaded first, by name.
func moduleDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	s := f.Section(".modinfo")
	if s == nil {
		return nil, fmt.Errorf("%s: no .modinfo section", path)
	}
	b, err := s.Data()
	if err != nil {
		return nil, err
	}
	for _, kv := range strings.Split(string(b), "\x00") {
		if v, ok := strings.CutPrefix(kv, "depends="); ok {
			if v == "" {
				return nil, nil
			}
			return strings.Split(v, ","), nil
		}
	}
	return nil, nil
}

// moduleClosure finds the named modules and everything they depend on under
// modDir (lib/modules/KVER), and returns their paths relative to modDir in
// load order (dependencies first). Names use '_' or '-' interchangeably, as
// modprobe does. A module the kernel package does not have is an error.
func moduleClosure(modDir string, names []string) ([]string, error) {
	byName := map[string]string{}
	err := filepath.WalkDir(filepath.Join(modDir, "kernel"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if n, ok := strings.CutSuffix(d.Name(), ".ko"); ok {
			rel, _ := filepath.Rel(modDir, p)
			byName[strings.ReplaceAll(n, "-", "_")] = rel
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var order []string
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(n string) error
	visit = func(n string) error {
		n = strings.ReplaceAll(n, "-", "_")
		switch state[n] {
		case 1:
			return fmt.Errorf("module dependency cycle at %s", n)
		case 2:
			return nil
		}
		rel, ok := byName[n]
		if !ok {
			return fmt.Errorf("kernel module %s not in the kernel package", n)
		}
		state[n] = 1
		deps, err := moduleDepends(filepath.Join(modDir, rel))
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d); err != nil {
				return fmt.Errorf("%s: %w", n, err)
			}
		}
		state[n] = 2
		order = append(order, rel)
		return nil
	}
	for _, n := range names {
		if err := visit(n); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// resolveIn follows the symbolic links of rel inside root (absolute targets
// are taken relative to root, as the guest will see them) and returns the
// host path of the file it names.
func resolveIn(root, rel string) (string, error) {
	p := filepath.Join(root, rel)
	for i := 0; i < 16; i++ {
		fi, err := os.Lstat(p)
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			return p, nil
		}
		target, err := os.Readlink(p)
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(target) {
			p = filepath.Join(root, target)
		} else {
			p = filepath.Join(filepath.Dir(p), target)
		}
	}
	return "", fmt.Errorf("%s: too many levels of symbolic links", rel)
}

// copyFile copies the file src names (following links) to dst, creating
// dst's directory and keeping the mode.
func copyFile(dst, src string) error {
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, fi.Mode().Perm())
}
