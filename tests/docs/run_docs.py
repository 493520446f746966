"""Runs the commands of README.md and docs/*.md as they are written.

    run_docs.py SOURCE_ROOT BUILD_DIR [FILE.md ...]

Each Markdown file runs in a sandbox of its own that stands for a fresh
machine after `make demo`: a private mount and PID namespace, with overlays
on /usr, /etc and /var, empty /run, /tmp and /root, the build installed
there (`meson install`, `ldconfig`), the docs' example user alice, a clean
environment (PATH as a fresh Debian root shell has it), and a copy of the
source tree as the working directory, with `build` its build tree.  When
the file is done, everything it started dies with its namespace, and the
machine's own /usr, /etc, /var and /run are untouched.

In a file, every fenced block whose info string is `sh` is run, in order,
by one bash (`set -e -o pipefail`), so that a variable or a daemon one
block starts serves the next.  An HTML comment on the line before a block
says otherwise:

    <!-- doc-test: file NAME -->        the block is the file NAME (written
                                        before the file's commands run)
    <!-- doc-test: output -->           the block is the stdout of the sh
    <!-- doc-test: output sorted -->    block before it (its lines in any
                                        order)
    <!-- doc-test: output of COMMAND --> the block is the stdout of COMMAND
                                        (run after the file's blocks, it
                                        must exit 0)
    <!-- doc-test: needs PATH -->       run the sh block only where PATH
                                        exists (a build with CUDA headers)
    <!-- doc-test: ci -->               CI runs these commands itself: each
                                        must be in .ci/run
    <!-- doc-test: skip REASON -->      not run, and the reason is printed

Every block not run is named with its reason on stdout and stderr.  Needs
root and unshare(1): without them it says so and exits 77 (skipped).
"""

import os
import re
import shutil
import subprocess
import sys

SKIP = 77
FRESH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# How long one file's commands may take (the Python example imports
# PyTorch twice, `make demo` moves 440 MiB).
FILE_TIMEOUT_S = 600

FENCE = re.compile(r"^```(.*)$")
NOTE = re.compile(r"^<!-- doc-test: (\w+)(?: (.*))? -->$")


class Block:
    def __init__(self, path, line, info, note, text):
        self.path = path
        self.line = line
        self.info = info.split()[0] if info.split() else ""
        self.kind, self.arg = note if note else (None, None)
        self.text = text

    def where(self):
        return "%s:%d" % (self.path, self.line)


def blocks_of(path, name):
    """The fenced blocks of a Markdown file with the note before each."""
    lines = open(path, encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        note = NOTE.match(lines[i - 1]) if i > 0 else None
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        out.append(Block(name, start + 1, m.group(1),
                         (note.group(1), note.group(2) or "") if note
                         else None,
                         "\n".join(body) + "\n"))
        i += 1
    return out


def say(text):
    print(text, flush=True)
    print(text, file=sys.stderr, flush=True)


def check_ci(block, source):
    """Every command of a `ci` block is one CI runs (.ci/run)."""
    ci = open(os.path.join(source, ".ci", "run"), encoding="utf-8").read()
    for line in block.text.splitlines():
        command = line.split("#", 1)[0].strip()
        if command and command not in ci:
            raise AssertionError("%s: `%s` is marked as run by CI, but "
                                 ".ci/run does not run it"
                                 % (block.where(), command))


# ---- the sandbox (inside the namespaces) ----

def sh(*args, **kw):
    subprocess.run(args, check=True, **kw)


def cover(directory, mode, keep):
    """An empty tmpfs over directory; the paths in keep that lie under it
    (the clone and its build, wherever they were made) are bound back from
    the directory's old contents, reached through a descriptor opened
    before it was covered (not canonicalized: the descriptor's path names
    the covered directory)."""
    old = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    sh("mount", "-t", "tmpfs", "-o", "mode=" + mode, "tmpfs", directory)
    bound = []
    for path in sorted(keep):
        inside_it = path.startswith(directory + "/")
        if not inside_it or any(path.startswith(b + "/") for b in bound):
            continue
        os.makedirs(path, exist_ok=True)
        sh("mount", "--no-canonicalize", "--bind", "/proc/self/fd/%d/%s"
           % (old, os.path.relpath(path, directory)), path, pass_fds=(old,))
        bound.append(path)
    os.close(old)


def make_sandbox(source, build):
    """Overlays and empty directories, the build installed, alice."""
    keep = {os.path.realpath(source), os.path.realpath(build)}
    cover("/tmp", "1777", keep)
    for d in ("usr", "etc", "var"):
        upper, work = "/tmp/.overlay/%s/upper" % d, "/tmp/.overlay/%s/work" % d
        os.makedirs(upper)
        os.makedirs(work)
        sh("mount", "-t", "overlay", "overlay", "-o",
           "lowerdir=/%s,upperdir=%s,workdir=%s" % (d, upper, work), "/" + d)
    cover("/run", "0755", keep)
    cover("/root", "0700", keep)
    sh("meson", "install", "-C", build, "--no-rebuild", "--quiet",
       stdout=subprocess.DEVNULL)
    sh("ldconfig")
    sh("useradd", "--no-create-home", "alice")


def copy_tree(source, dest, build):
    """The source tree as a fresh clone has it, and build/ its build."""
    files = subprocess.run(
        ["git", "-C", source, "ls-files", "-z", "--cached", "--others",
         "--exclude-standard"], check=True, capture_output=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = os.path.join(source, rel)
        if not os.path.isfile(src):
            continue  # a file deleted in the working tree
        dst = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
    os.symlink(os.path.abspath(build), os.path.join(dest, "build"))


def run_file(source, build, name):
    """Runs one Markdown file's blocks in this (fresh) sandbox; returns the
    failures as text."""
    blocks = blocks_of(os.path.join(source, name), name)
    failures = []
    work = "/tmp/doc-test"
    os.makedirs(work)
    copy_tree(source, work, build)
    state = os.path.join(work, ".doc-test")
    os.makedirs(state)
    # SP_DOCS_TEST: a docs test started by these commands (make check)
    # would run them again, and again.
    env = {"PATH": FRESH_PATH, "HOME": "/root", "LANG": "C.UTF-8",
           "TERM": "dumb", "USER": "root", "LOGNAME": "root",
           "SP_DOCS_TEST": "1"}

    script = ["set -e -o pipefail", "cd %s" % work]
    runs = []  # (block, index) of the sh blocks run
    expected = []  # (block, the run block it follows, or None)
    last = None
    for b in blocks:
        if b.kind == "file":
            with open(os.path.join(work, b.arg), "w") as f:
                f.write(b.text)
            continue
        if b.kind == "skip":
            say("doc-test: NOT RUN: %s: %s" % (b.where(), b.arg))
            continue
        if b.kind == "ci":
            check_ci(b, source)
            say("doc-test: NOT RUN here: %s: CI runs it (.ci/run)"
                % b.where())
            continue
        if b.kind == "output":
            expected.append((b, last))
            continue
        if b.kind == "needs" and not os.path.exists(os.path.join(work, b.arg)):
            say("doc-test: NOT RUN: %s: this build has no %s"
                % (b.where(), b.arg))
            last = None
            continue
        if b.info != "sh" or b.kind not in (None, "needs"):
            continue
        i = len(runs)
        runs.append(b)
        last = b
        script.append("echo %d > %s/current" % (i, state))
        script.append("{\n%s} >%s/out.%d 2>%s/err.%d" % (b.text, state, i,
                                                         state, i))

    if runs:
        try:
            proc = subprocess.run(["bash", "-c", "\n".join(script) + "\n"],
                                  env=env, cwd=work, timeout=FILE_TIMEOUT_S)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            status = "timed out after %d s" % FILE_TIMEOUT_S
        if status != 0:
            i = int(open(os.path.join(state, "current")).read())
            b = runs[i]
            failures.append(
                "%s: the block failed (%s):\n%s--- its stdout:\n%s--- its "
                "stderr:\n%s" % (b.where(), status, b.text,
                                 read(state, "out.%d" % i),
                                 read(state, "err.%d" % i)))
            return failures

    for b, after in expected:
        if b.arg.startswith("of "):
            command = b.arg[3:]
            proc = subprocess.run(["bash", "-o", "pipefail", "-c", command],
                                  env=env, cwd=work, capture_output=True,
                                  text=True, timeout=60)
            got, ok = proc.stdout, proc.returncode == 0
            what = "`%s`" % command
            if not ok:
                failures.append("%s: %s exited %d: %s%s" % (
                    b.where(), what, proc.returncode, got, proc.stderr))
                continue
        elif after is None:
            failures.append("%s: an output block after no block that ran"
                            % b.where())
            continue
        else:
            got = read(state, "out.%d" % runs.index(after))
            what = "the block at %s" % after.where()
        want = b.text
        if b.arg == "sorted":
            got, want = sorted(got.splitlines()), sorted(want.splitlines())
        if got != want:
            failures.append("%s: %s printed\n%s\nnot what the docs show:\n%s"
                            % (b.where(), what, fmt(got), fmt(want)))
    return failures


def read(state, name):
    path = os.path.join(state, name)
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def fmt(text):
    return "\n".join(text) + "\n" if isinstance(text, list) else text


def inside(source, build, name):
    make_sandbox(source, build)
    failures = run_file(source, build, name)
    for f in failures:
        print("FAIL: " + f, file=sys.stderr, flush=True)
    return 1 if failures else 0


# ---- the driver ----

def markdown_files(source, names):
    if names:
        return names
    docs = sorted("docs/" + n for n in os.listdir(os.path.join(source, "docs"))
                  if n.endswith(".md"))
    return ["README.md"] + docs


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--inside":
        sys.exit(inside(*sys.argv[2:5]))
    source, build = sys.argv[1], sys.argv[2]
    if os.environ.get("SP_DOCS_TEST"):
        say("SKIPPED: the docs' commands are being run already (a docs "
            "command started this test suite)")
        sys.exit(SKIP)
    if os.geteuid() != 0 or subprocess.run(
            ["unshare", "-m", "-p", "-f", "--propagation", "private", "true"],
            stderr=subprocess.DEVNULL).returncode != 0:
        say("SKIPPED: the docs' commands need root and unshare(1) for a "
            "private mount and PID namespace")
        sys.exit(SKIP)
    failed = []
    for name in markdown_files(source, sys.argv[3:]):
        blocks = blocks_of(os.path.join(source, name), name)
        if not any(b.info == "sh" or b.kind in ("output", "file")
                   for b in blocks):
            continue
        print("doc-test: %s" % name, flush=True)
        rc = subprocess.run(
            ["unshare", "-m", "-p", "-f", "--propagation", "private",
             sys.executable, os.path.abspath(__file__), "--inside",
             os.path.abspath(source), os.path.abspath(build), name]).returncode
        if rc != 0:
            failed.append(name)
    if failed:
        print("doc-test: commands that do not run as written in: %s"
              % ", ".join(failed), file=sys.stderr)
        sys.exit(1)
    print("doc-test: every command ran as written")


if __name__ == "__main__":
    main()
