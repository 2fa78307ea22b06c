"""A Kafka broker kit for a machine that has Python but no Java, no Maven and no network:
the GPU machine this project is sometimes lent, where the throughput bench must run its
own broker beside the real engine (ops/device/throughput_gpu.sh).

The kit is one archive and a few wheels, small enough to travel with a device call
(64 MiB in all, the working tree included):
- a Java runtime cut to the modules Kafka's jars use (jlink; `jdeps --print-module-deps`
  over the broker's jars named these, plus TLS's elliptic curves and the JMX platform
  beans), native debug symbols stripped;
- the broker's jars (ops/kafka/pom.xml, resolved here by Maven), their entries stored
  rather than deflated and native libraries for other platforms left out, so that the
  archive's xz finds the repetition across classes: 14.8 MB, against 41 MB for the jars as they are;
- the wheels of the workers' dependencies that a CUDA PyTorch image does not carry
  (msgspec, aiokafka, ...), at the versions installed here, for the device's Python.

    python ops/device/kafka_kit.py pack [--out .kit] [--python-version 3.12] [--no-wheels] [--no-compress]
    python ops/device/kafka_kit.py unpack [--kit .kit] --into DIR     # prints the `export` lines to eval
    python ops/device/kafka_kit.py check [--kit .kit]                 # a broker from the kit, here

`unpack` puts the jars where `genpipe broker up` looks for them (GENPIPE_CACHE_DIR=DIR/cache,
marked as resolved for this checkout's pom), and prints PATH with the kit's java first.
`check` unpacks into a temporary directory and starts a broker with nothing but the kit's
java on PATH, asks it for its topics, and stops it: what `pack` made works without the
machine's own Java. `.kit/` is git-ignored; pass it to the device tool's `carry`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ops" / "bench"))

from soak import free_port  # noqa: E402  (ops/bench/soak.py)
from workers.broker.local import BrokerError, adopt_jars, ensure_jars, kafka_version  # noqa: E402

ARCHIVE = "kafka-kit.tar"
# jdeps --ignore-missing-deps --multi-release 17 --print-module-deps over kafka_2.13,
# kafka-server, -clients, -raft, -metadata and -storage gave java.base, java.compiler,
# java.desktop, java.management, java.naming, java.rmi, java.scripting,
# java.security.jgss, java.security.sasl, java.sql, jdk.unsupported; the rest are
# looked up by name at run time (TLS curves, JMX's platform beans, java.util.logging).
MODULES = ("java.base", "java.compiler", "java.desktop", "java.logging", "java.management",
           "java.naming", "java.rmi", "java.scripting", "java.security.jgss", "java.security.sasl",
           "java.sql", "java.xml", "jdk.crypto.ec", "jdk.management", "jdk.unsupported")
# What the workers and the benches import that a CUDA PyTorch image (torch, transformers,
# tokenizers, numpy, packaging, typing_extensions) does not have.
WHEELS = ("msgspec", "aiokafka", "async-timeout", "prometheus-client", "uvloop")
# What aiokafka needs that such an image has: in wheels/fallback/, installed only where
# the import fails (throughput_gpu.sh), so as not to shadow the image's own versions.
FALLBACK_WHEELS = ("typing-extensions", "packaging")
# Native libraries inside jars, for platforms other than Linux x86-64, are left out.
_NATIVE = (".so", ".dll", ".dylib", ".jnilib")
_THIS_PLATFORM = ("linux/amd64/", "Linux/x86_64/", "linux/x86_64/", "linux-x86_64/")


def restore_jar(src: Path, dst: Path) -> None:
    """`src` with its entries stored (xz compresses raw classes far better than deflated
    ones) and other platforms' native libraries left out; a signed jar is copied as is."""
    with zipfile.ZipFile(src) as jar:
        if any(n.startswith("META-INF/") and n.endswith((".SF", ".RSA", ".DSA", ".EC")) for n in jar.namelist()):
            shutil.copy2(src, dst)
            return
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as out:
            for info in jar.infolist():
                if info.filename.endswith(_NATIVE) and not any(p in info.filename for p in _THIS_PLATFORM):
                    continue
                out.writestr(info, jar.read(info), compress_type=zipfile.ZIP_STORED)


def java_runtime(out: Path) -> None:
    jlink = shutil.which("jlink")
    if jlink is None:
        raise SystemExit("jlink not found: pack needs a JDK 17+ (e.g. apt-get install openjdk-17-jdk-headless)")
    cmd = [jlink, "--add-modules", ",".join(MODULES), "--strip-debug", "--no-header-files",
           "--no-man-pages", "--compress=0", "--output", str(out)]  # (--compress=0: xz does better)
    objcopy = shutil.which("objcopy")
    if objcopy:
        cmd[-2:-2] = [f"--strip-native-debug-symbols=objcopy={objcopy}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"jlink failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")


def download_wheels(out: Path, python_version: str, names: tuple[str, ...] = WHEELS) -> list[str]:
    """The wheels of `names`, at the versions installed here, built for CPython
    `python_version` on manylinux x86-64 (pip fetches them from the package index)."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in names]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           *[f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")],
           "-d", str(out), *pins]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip download failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return pins


def pack(out: Path, python_version: str, wheels: bool, compress: bool) -> dict:
    libs = ensure_jars()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(ARCHIVE + "*"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="genpipe-kit-") as tmp:
        stage = Path(tmp)
        java_runtime(stage / "jre")
        (stage / "libs").mkdir()
        for jar in sorted(libs.glob("*.jar")):
            restore_jar(jar, stage / "libs" / jar.name)
        archive = out / (ARCHIVE + (".xz" if compress else ""))
        with tarfile.open(archive, "w:xz" if compress else "w") as tar:
            tar.add(stage / "jre", "jre")
            tar.add(stage / "libs", "libs")
    pins = []
    if wheels:
        shutil.rmtree(out / "wheels", ignore_errors=True)
        pins = download_wheels(out / "wheels", python_version)
        pins += download_wheels(out / "wheels" / "fallback", python_version, FALLBACK_WHEELS)
    manifest = {"kafka": kafka_version(), "archive": archive.name, "archive_bytes": archive.stat().st_size,
                "java_modules": list(MODULES), "python": python_version if wheels else None, "wheels": pins,
                "wheel_bytes": sum(w.stat().st_size for w in (out / "wheels").rglob("*.whl")) if wheels else 0}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def unpack(kit: Path, into: Path) -> dict[str, str]:
    """Extract the kit into `into` and place its jars; returns the environment to use."""
    manifest = json.loads((kit / "manifest.json").read_text())
    if manifest["kafka"] != kafka_version():
        raise SystemExit(f"the kit holds Kafka {manifest['kafka']}, this checkout's pom wants "
                         f"{kafka_version()}: pack it again")
    into = into.resolve()
    shutil.rmtree(into / "jre", ignore_errors=True)
    with tarfile.open(kit / manifest["archive"]) as tar:
        try:
            tar.extractall(into, filter="tar")  # (keeps the runtime's exec bits, refuses paths out of `into`)
        except TypeError:  # a Python before the extraction filters (3.11.4, 3.10.12)
            tar.extractall(into)
    env = {"GENPIPE_CACHE_DIR": str(into / "cache"),
           "PATH": os.pathsep.join([str(into / "jre" / "bin"), os.environ.get("PATH", "")])}
    os.environ["GENPIPE_CACHE_DIR"] = env["GENPIPE_CACHE_DIR"]  # (adopt_jars places them there)
    adopt_jars(into / "libs")
    return env


def check(kit: Path) -> None:
    """A broker from the kit alone: java only from the kit on PATH."""
    from workers.broker.local import answers

    with tempfile.TemporaryDirectory(prefix="genpipe-kit-check-") as tmp:
        env = os.environ | unpack(kit, Path(tmp) / "kit")
        env["PATH"] = str(Path(tmp) / "kit" / "jre" / "bin")  # no other java to find
        java = shutil.which("java", path=env["PATH"])
        port = free_port()
        data = Path(tmp) / "data"
        cli = [sys.executable, "-m", "workers.cli", "broker"]
        started = time.monotonic()
        up = subprocess.run([*cli, "up", "--port", str(port), "--data-dir", str(data)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=180)
        try:
            if up.returncode != 0:
                raise SystemExit(f"the kit's broker did not start (exit {up.returncode}):\n{up.stdout}{up.stderr}")
            if not answers(port):
                raise SystemExit(f"the kit's broker on port {port} does not answer")
            print(f"kit OK: a broker on 127.0.0.1:{port} from {java}, up in {time.monotonic() - started:.1f} s")
        finally:
            subprocess.run([*cli, "down", "--port", str(port), "--data-dir", str(data)], env=env, cwd=ROOT,
                           capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="build the kit (needs a JDK's jlink, Maven and the package index)")
    p.add_argument("--out", type=Path, default=ROOT / ".kit")
    p.add_argument("--python-version", default="3.12", help="the device's Python, for the wheels (default 3.12)")
    p.add_argument("--no-wheels", action="store_true", help="leave the Python wheels out")
    p.add_argument("--no-compress", action="store_true", help="a plain tar (faster to pack, ~8x larger)")
    u = sub.add_parser("unpack", help="extract the kit and print the environment to eval")
    u.add_argument("--kit", type=Path, default=ROOT / ".kit")
    u.add_argument("--into", type=Path, required=True)
    c = sub.add_parser("check", help="start and stop a broker from the kit, with no other java on PATH")
    c.add_argument("--kit", type=Path, default=ROOT / ".kit")
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            manifest = pack(args.out, args.python_version, not args.no_wheels, not args.no_compress)
            print(f"kit in {args.out}: {manifest['archive']} {manifest['archive_bytes'] / 2**20:.1f} MiB, "
                  f"wheels {manifest['wheel_bytes'] / 2**20:.1f} MiB ({', '.join(manifest['wheels']) or 'none'})")
        elif args.command == "unpack":
            for name, value in unpack(args.kit, args.into).items():
                print(f"export {name}={shlex.quote(value)}")
        else:
            check(args.kit)
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
