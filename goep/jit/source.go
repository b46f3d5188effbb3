package jit

import (
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strings"

	"github.com/pyep/pyep/kernels"
)

// Source is one CUDA C++ translation unit and the headers it may include.
type Source struct {
	// Name identifies the source in logs, NVRTC diagnostics and cache file names, e.g.
	// "kernels/intranode.cu".
	Name string
	Text string
	// Headers are handed to NVRTC by name, as NVRTC has no file system access of its own here.
	// Sources from FromFS carry exactly the headers they include (transitively), so that a
	// change to an unrelated header does not invalidate their cache entries.
	Headers []Header
}

// Kernel returns the embedded kernel source name (e.g. "intranode.cu") with its headers.
func Kernel(name string) (Source, error) {
	src, err := FromFS(kernels.FS, name)
	if err != nil {
		return Source{}, err
	}
	src.Name = "kernels/" + name
	return src, nil
}

// KernelNames lists the embedded kernel sources (*.cu), sorted.
func KernelNames() ([]string, error) {
	names, err := fs.Glob(kernels.FS, "*.cu")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	return names, nil
}

var includeRE = regexp.MustCompile(`(?m)^[ \t]*#[ \t]*include[ \t]*[<"]([^>"\n]+)[>"]`)

// FromFS reads name from fsys together with the headers it includes, transitively. Includes
// are resolved against the including file's directory, then fsys's root; those found in
// neither are left to NVRTC (which knows none but its built-ins, so they will fail there, with
// NVRTC's message naming the file).
func FromFS(fsys fs.FS, name string) (Source, error) {
	text, err := fs.ReadFile(fsys, name)
	if err != nil {
		return Source{}, fmt.Errorf("pyep: reading kernel source: %w", err)
	}
	src := Source{Name: name, Text: string(text)}
	seen := map[string]bool{}
	queue := []struct{ from, text string }{{name, src.Text}}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		for _, m := range includeRE.FindAllStringSubmatch(cur.text, -1) {
			inc := m[1]
			if seen[inc] {
				continue
			}
			seen[inc] = true
			for _, p := range []string{path.Join(path.Dir(cur.from), inc), path.Clean(inc)} {
				if body, err := fs.ReadFile(fsys, p); err == nil {
					src.Headers = append(src.Headers, Header{Name: inc, Text: string(body)})
					queue = append(queue, struct{ from, text string }{p, string(body)})
					break
				}
			}
		}
	}
	sort.Slice(src.Headers, func(i, j int) bool { return src.Headers[i].Name < src.Headers[j].Name })
	return src, nil
}

var (
	definesLineRE = regexp.MustCompile(`(?m)^[ \t]*//[ \t]*pyep:defines[ \t]+(.*)$`)
	identRE       = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// DefineSets returns the configurations a source declares in "// pyep:defines NAME=VALUE ..."
// comment lines, one map per line (a bare NAME maps to ""). Tests compile each one, so a kernel
// is checked in CI under the constants it will really see, not only under its defaults.
func (s Source) DefineSets() ([]map[string]string, error) {
	var sets []map[string]string
	for _, m := range definesLineRE.FindAllStringSubmatch(s.Text, -1) {
		set := map[string]string{}
		for _, tok := range strings.Fields(m[1]) {
			name, value, _ := strings.Cut(tok, "=")
			if !identRE.MatchString(name) {
				return nil, fmt.Errorf("pyep: %s: pyep:defines: %q is not NAME=VALUE", s.Name, tok)
			}
			set[name] = value
		}
		sets = append(sets, set)
	}
	return sets, nil
}
