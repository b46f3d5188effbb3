"""Builds pyep: the Go core is bound by gopy into python/pyep/_gopy at build time.

Building needs Go >= 1.24 on PATH (or in $GOROOT/bin) and nothing else: gopy and goimports are
pinned as tools in go.mod and built here; no CUDA toolkit is needed (CUDA libraries are opened at
run time).
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
MIN_GO = (1, 24)
# gopy names the native module _<NAME>; Go ignores files that start with "_", so NAME does not.
GOPY_NAME = "core"


def version():
    with open(os.path.join(ROOT, "goep", "version.go")) as f:
        return re.search(r'Version = "([^"]+)"', f.read()).group(1)


def find_go():
    candidates = [shutil.which("go")]
    if os.environ.get("GOROOT"):
        candidates.append(os.path.join(os.environ["GOROOT"], "bin", "go"))
    candidates += ["/usr/local/go/bin/go", os.path.expanduser("~/go/bin/go")]
    found = None
    for go in filter(None, candidates):
        if not os.path.exists(go):
            continue
        out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()
        m = re.match(r"go(\d+)\.(\d+)", out)
        if m and (int(m.group(1)), int(m.group(2))) >= MIN_GO:
            return go
        found = found or f"{go} is {out or 'unusable'}"
    raise SystemExit(f"pyep: building needs Go {MIN_GO[0]}.{MIN_GO[1]} or newer as `go` on PATH "
                     f"({found or 'no go command found'}); install Go, then run pip again.")


def run(cmd, env, cwd=ROOT):
    print("pyep build:", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=cwd, check=True)


class BuildGo(build_py):
    """Builds the gopy extension and places it in the package as pyep/_gopy."""

    def run(self):
        super().run()
        go = find_go()
        work = tempfile.mkdtemp(prefix="pyep-build-")
        tools = os.path.join(work, "bin")
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([tools, os.path.dirname(go), env.get("PATH", "")])
        env.setdefault("CGO_ENABLED", "1")
        run([go, "build", "-o", tools + os.sep, "github.com/go-python/gopy", "golang.org/x/tools/cmd/goimports"], env)
        # gopy builds in its output folder with `go build`, which must lie inside this module; a folder whose name
        # starts with "_" is left out of `./...`, so `go vet ./...` and `go test ./...` never see the generated code.
        out = os.path.join(ROOT, "build", "_gopy")
        shutil.rmtree(out, ignore_errors=True)
        run([os.path.join(tools, "gopy"), "build", f"-output={out}", f"-name={GOPY_NAME}",
             f"-vm={sys.executable}", "-dynamic-link=true", "-no-make=true", "./pyep"], env)
        dest = os.path.join(self.build_lib, "pyep", "_gopy")
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for name in ("__init__.py", "go.py", "pyep.py", f"_{GOPY_NAME}{suffix}"):
            shutil.copy2(os.path.join(out, name), dest)
        shutil.rmtree(work, ignore_errors=True)


class BinaryDistribution(Distribution):
    """The package carries a native extension, so wheels are platform wheels."""

    def has_ext_modules(self):
        return True


setup(version=version(), cmdclass={"build_py": BuildGo}, distclass=BinaryDistribution)
