"""A Python job in a container, for the container-mode tests (issue 36): a counter over 16 MiB of
its own memory that writes its progress to /tmp/progress and ends by printing `done DIGEST`.
Its digest depends on every step and on the whole memory at the end, so a job restored from
a snapshot prints exactly the digest of an uninterrupted run only if it carried on from where
it was, with its memory intact.

The image holds a minimal root built from the host's own Python: the interpreter, the shared
libraries `ldd` names for it and for the extension modules the job loads, the standard-library
files the job imports (found by importing them on the host), and this file as /job.py. It is
imported into Podman or Docker under a tag made of a hash of everything that went in, so a
rerun finds it and builds nothing.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

PAGE = 4096
PAGES = 4096                        # 16 MiB, each page its own bytes: a second dump finds them stored


def _state() -> bytearray:
    return bytearray(b"".join(hashlib.sha256(i.to_bytes(4, "little")).digest() * (PAGE // 32)
                              for i in range(PAGES)))


def run(steps: int, delay: float, progress=None) -> str:
    """The job: each step changes one page of the state and feeds the digest."""
    h, state = hashlib.sha256(), _state()
    for i in range(steps):
        off = (i * 7 % PAGES) * PAGE
        state[off:off + 8] = i.to_bytes(8, "little")
        h.update(state[off:off + 64])
        if progress:
            progress(i + 1)
        if delay:
            time.sleep(delay)
    h.update(hashlib.sha256(state).digest())
    return h.hexdigest()


def _write_progress(i: int) -> None:
    # replaced whole, so that a reader never sees an empty or half-written file
    with open("/tmp/progress.new", "w") as f:
        f.write(str(i))
    os.replace("/tmp/progress.new", "/tmp/progress")


if __name__ == "__main__":
    print("start", flush=True)
    print("done", run(int(sys.argv[1]), float(sys.argv[2]), _write_progress), flush=True)


# -- the image (only the tests use what follows; the job in the container never runs it) --

def _host_python() -> str:
    """Debian's own Python (not one a user put first on PATH, as pyenv does)."""
    import shutil

    return os.path.realpath("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3"))


def _files() -> list[str]:
    """Every host file the root needs: the interpreter, the modules the job loads (as the
    host's own Python loads them, isolated and without site), and their shared libraries."""
    import subprocess

    exe = _host_python()
    # this file run as the job runs it (module level, then a few steps), then what it loaded
    code = ("import sys; f = sys.argv[1]; ns = {'__name__': 'job'}; "
            "exec(compile(open(f).read(), f, 'exec'), ns); ns['run'](2, 0); "
            "print('\\n'.join(sorted({getattr(m, '__file__', None) or '' for m in list(sys.modules.values())} - {''})))")
    mods = subprocess.run([exe, "-I", "-S", "-c", code, __file__], capture_output=True, text=True,
                          check=True).stdout.split()
    mods = [m for m in mods if m != __file__]
    files = {exe, *mods}
    for f in [exe, *(m for m in mods if m.endswith(".so"))]:
        out = subprocess.run(["ldd", f], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
            if path.startswith("/"):
                files.add(path)
    return sorted(files)


def image_tag() -> tuple[str, list[str]]:
    """The image's tag (a hash of every file that goes in, and of this job) and those files."""
    files = _files()
    h = hashlib.sha256(open(__file__, "rb").read())
    for f in files:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return f"localhost/gpusnap-test-py:{h.hexdigest()[:16]}", files


def rootfs_tar(files: list[str]) -> bytes:
    """The root as a tar stream: the files at their host paths (links resolved), /usr/bin/python3,
    /job.py and a /tmp."""
    import io
    import tarfile

    exe = _host_python()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs: set[str] = set()

        def add_dirs(path: str) -> None:
            parent = os.path.dirname(path)
            if parent in ("/", "") or parent in dirs:
                return
            add_dirs(parent)
            dirs.add(parent)
            ti = tarfile.TarInfo(parent.lstrip("/"))
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(ti)

        for f in files:
            add_dirs(f)
            tar.add(os.path.realpath(f), arcname=f.lstrip("/"), recursive=False)
        # the interpreter under the name the image runs; /lib64 holds the dynamic loader
        add_dirs("/usr/bin/python3")
        if exe != "/usr/bin/python3":
            ti = tarfile.TarInfo("usr/bin/python3")
            ti.type, ti.linkname = tarfile.SYMTYPE, os.path.basename(exe)
            tar.addfile(ti)
        add_dirs("/job.py")
        tar.add(__file__, arcname="job.py", recursive=False)
        ti = tarfile.TarInfo("tmp")
        ti.type, ti.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(ti)
    return buf.getvalue()


def ensure_image(engine: list[str]) -> str:
    """The image in the engine (`podman` or `docker -H ...` as argv), imported once; its tag."""
    import subprocess

    tag, files = image_tag()
    have = subprocess.run([*engine, "image", "inspect", tag], capture_output=True, timeout=120)
    if have.returncode != 0:
        r = subprocess.run([*engine, "import", "-", tag], input=rootfs_tar(files), capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
    return tag


def command(steps: int, delay: float) -> list[str]:
    return ["/usr/bin/python3", "-I", "-S", "/job.py", str(steps), str(delay)]
