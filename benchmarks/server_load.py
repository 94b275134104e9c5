"""``mlx_lm.server`` under concurrent load: stock batching without a drafter
against the server with a drafter (batched through mlx-dspark, and one
request at a time), real server processes over HTTP.

For each concurrency N, the modes take turns (one wave each, ``--waves``
times): a wave sends N streaming chat requests at once, each with its own
prompt, and waits for all of them. Reported per mode and N: aggregate
tokens/s (completion tokens of the wave over its wall time; with the
range of one wave's ratio to stock's wave beside it), the median
per-request tokens/s (completion tokens over the request's own time) and
time to first token (p50, p95) with the part of it spent before the server
took the request off its queue (until the response starts), plus the aggregate ratio to
stock. A response that waited over a second between two chunks is listed
with the time it ended, to find in the servers' logs (``--logs``).

Two server processes of one mode can differ as much as two modes do.
``--servers K`` starts K processes per mode; the processes take turns wave
by wave, each mode's waves are pooled, and each process's own rate is
reported beside the pooled one.

Waves end with their slowest request, so a batch that finishes its requests
at different times pays for its tail in every wave. ``--sustain S`` measures
the steady state instead: each of the N clients sends requests back to back
for S seconds. On MLX-CUDA some shapes compile kernels for seconds the first
time a machine meets them (kept on disk after that), which favours the
servers started later; ``--prime`` runs every server at every concurrency
once before measuring, and first measures the round costs the batched
servers' policy reads (``mlx_dspark costs``: a server that has served before
has them on disk; a fresh one measures them over its first rounds). With ``--log-level DEBUG``, each batched server's
``next()`` after priming is summed by part at the end (from its load
lines: rounds of their own, rounds that also copied or handed back caches,
prefill, ...).

Default: the bundled tiny Gemma-4 pair on this machine, real acceptance.
With ``--replay-tau`` the servers replay that mean acceptance length
(``speculative.replayed_acceptance``), for random-weight pairs such as the
12B-shaped ones ``write_shapes.py`` writes.
"""

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlx_dspark.progress import progress

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspec-tiny"
MODES = {
    "stock": [],
    "batched": ["--draft-model", "{draft}", "--draft-batch-policy", "cost"],
    "batched-fixed": ["--draft-model", "{draft}", "--draft-batch-policy", "fixed"],
    "batched-fixed-pipelined": ["--draft-model", "{draft}", "--draft-batch-policy", "fixed"],
    "one-at-a-time": ["--draft-model", "{draft}", "--draft-batch-policy", "off"],
}
# Rounds pipelined, against the server's rounds read one by one.
MODE_ENV = {"batched-fixed-pipelined": {"MLX_DSPARK_SERVER_PIPELINE": "1"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_variant(text: str):
    """``NAME=MODE:VAR=VALUE,...`` -> ``(NAME, MODE, {VAR: VALUE})``: a mode
    of its own, served as ``MODE`` with those environment variables."""
    name, _, rest = text.partition("=")
    base, _, assignments = rest.partition(":")
    if not name or base not in MODES or name in MODES:
        raise ValueError(
            f"--variant {text!r}: expected NAME=MODE:VAR=VALUE,... with a new NAME "
            f"and MODE one of {', '.join(MODES)}"
        )
    pairs = [a.partition("=") for a in assignments.split(",") if a]
    if any(not var or not eq for var, eq, _ in pairs):
        raise ValueError(f"--variant {text!r}: each setting is VAR=VALUE")
    return name, base, {var: value for var, _, value in pairs}


def mode_table(modes, variants):
    """``({mode: MODE served as}, {mode: environment})`` for ``--modes``
    with the ``--variant`` texts: every mode named is known, and every
    variant is among the modes named (else it would be left out silently)."""
    bases = {mode: mode for mode in MODES}
    envs = dict(MODE_ENV)
    for text in variants:
        name, base, env = parse_variant(text)
        if name not in modes:
            raise ValueError(f"--variant {text!r}: list {name} in --modes to serve it")
        bases[name] = base
        envs[name] = {**MODE_ENV.get(base, {}), **env}
    unknown = [mode for mode in modes if mode not in bases]
    if unknown:
        raise ValueError(f"--modes: no mode {', '.join(unknown)}; modes: {', '.join(bases)}")
    return bases, envs


class Server:
    def __init__(self, model, flags, log_dir, name, mode_env):
        self.port = free_port()
        self.log = Path(log_dir) / f"{name}.log"
        env = {**os.environ, **mode_env}
        env.pop("MLX_DSPARK_DISABLE", None)
        self.process = subprocess.Popen(
            [
                sys.executable, str(Path(__file__).with_name("serve.py")),
                "--model", str(model), "--port", str(self.port), *flags,
            ],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(self.log.read_text())
            try:
                self.chat("w5", 1)
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(self.log.read_text())

    def chat(self, content, max_tokens):
        """One streaming chat request: ``(ttft, seconds, completion_tokens,
        headers, gap)``, ``headers`` the wait for the response to start (the
        server starts it when its generation thread takes the request,
        before the request joins the batch), ``gap`` the longest wait between
        two chunks after the first token and the wall-clock time it ended (to
        find it in the servers' logs)."""
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        first, tokens, last, gap = None, 0, start, (0.0, 0.0)
        try:
            response = urllib.request.urlopen(request, timeout=600)
            headers = time.perf_counter() - start
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code}: {e.read().decode()[:500]}") from None
        with response:
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if first is not None and now - last > gap[0]:
                    gap = (now - last, time.time())
                if first is None and chunk.get("choices"):
                    first = now - start
                last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return first or 0.0, time.perf_counter() - start, tokens, headers, gap

    def chat_retrying(self, content, max_tokens):
        # The stock HTTP server listens with a backlog of 5: a connection it
        # resets before reading the request was never served, so resend it.
        for attempt in range(10):
            try:
                return self.chat(content, max_tokens)
            except ConnectionResetError:
                time.sleep(0.05 * (attempt + 1))
        raise ConnectionResetError("the server kept resetting the connection")

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)


# A wait this long between two chunks of one response is reported.
STALL_SECONDS = 1.0


def prompt(wave: int, i: int, words: int) -> str:
    return " ".join(f"w{(wave * 131 + i * 37 + j * 11) % 500 + 5}" for j in range(words))


def wave(server, n, wave_index, max_tokens, words, sustain=None):
    """N clients at once, each sending one request, or with ``sustain``
    each sending requests back to back for that many seconds (the wave
    then ends when the last request started in time ends)."""

    def client(i):
        if sustain is None:
            return [server.chat_retrying(prompt(wave_index, i, words), max_tokens)]
        done, end = [], time.perf_counter() + sustain
        while time.perf_counter() < end:
            content = prompt(wave_index * 100 + len(done), i, words)
            done.append(server.chat_retrying(content, max_tokens))
        return done

    tic = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = [r for rs in pool.map(client, range(n)) for r in rs]
    wall = time.perf_counter() - tic
    return {
        "wall": wall,
        "tokens": sum(r[2] for r in results),
        "ttft": [r[0] for r in results],
        "headers": [r[3] for r in results],
        "per_request": [r[2] / r[1] for r in results if r[1] > 0],
        "stalls": [
            {"request": i, "seconds": r[4][0], "ended": r[4][1]}
            for i, r in enumerate(results) if r[4][0] > STALL_SECONDS
        ],
    }


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarise(waves):
    tokens = sum(w["tokens"] for w in waves)
    wall = sum(w["wall"] for w in waves)
    ttft = [t for w in waves for t in w["ttft"]]
    per_request = [t for w in waves for t in w["per_request"]]
    headers = [t for w in waves for t in w["headers"]]
    return {
        "aggregate_tps": tokens / wall,
        "wave_tps": [w["tokens"] / w["wall"] for w in waves],
        "per_request_tps": statistics.median(per_request),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p95": percentile(ttft, 0.95),
        "headers_p50": percentile(headers, 0.5),
        "headers_p95": percentile(headers, 0.95),
        "stalls": [dict(s, wave=i) for i, w in enumerate(waves) for s in w["stalls"]],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY / "target_tiny_gemma4"))
    parser.add_argument("--draft-model", default=str(TINY / "dspark_tiny_gemma4_block4"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["stock", "batched", "one-at-a-time"])
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=MODE:VAR=VALUE,...",
        help="a mode NAME served as MODE with these environment variables set, "
        "e.g. batched-no-graphs=batched:MLX_USE_CUDA_GRAPHS=0 (then list NAME in --modes)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument(
        "--servers", type=int, default=1,
        help="server processes per mode, their waves interleaved and pooled per mode "
        "(two processes of one mode can differ by as much as two modes do)",
    )
    parser.add_argument(
        "--sustain", type=float,
        help="seconds each wave's clients keep sending requests back to back "
        "(default: one request each, the wave ends with the slowest)",
    )
    parser.add_argument("--replay-tau", type=float, help="replayed acceptance (random-weight pairs)")
    parser.add_argument("--replay-block", type=int, default=7, help="the drafter's block size")
    parser.add_argument(
        "--prime", action="store_true",
        help="before measuring, every server runs one wave at every concurrency, so "
        "that kernels compiled on first use (MLX-CUDA) are compiled for every mode alike; "
        "and the batched servers' round costs are measured ahead (mlx_dspark costs)",
    )
    parser.add_argument("--logs", help="keep the servers' logs in this folder")
    parser.add_argument("--log-level", default="INFO", help="the servers' --log-level (DEBUG: the batch policy's decisions)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.servers < 1:
        parser.error("--servers: at least one server process per mode")
    try:
        bases, envs = mode_table(args.modes, args.variant)
    except ValueError as e:
        parser.error(str(e))
    if args.replay_tau:
        os.environ["MLX_DSPARK_REPLAY_TAU"] = str(args.replay_tau)
        os.environ["MLX_DSPARK_REPLAY_BLOCK"] = str(args.replay_block)

    with tempfile.TemporaryDirectory() as scratch:
        logs = args.logs or scratch
        Path(logs).mkdir(parents=True, exist_ok=True)
        if args.prime:
            # Before the servers load, so that one more copy of the target
            # needs no room beside theirs; once per environment of a batched
            # mode (MLX's launch settings are part of the costs' key).
            environments = {
                json.dumps(envs.get(mode, {}), sort_keys=True)
                for mode in args.modes if bases[mode] == "batched"
            }
            for env in map(json.loads, sorted(environments)):
                suffix = "".join(f"-{k}-{v}" for k, v in sorted(env.items()))
                measure_costs(args, Path(logs) / f"costs{suffix}.log", env)
        servers = {}
        try:
            for i in range(args.servers):
                for mode in args.modes:
                    name = server_name(mode, i, args.servers)
                    flags = [f.format(draft=args.draft_model) for f in MODES[bases[mode]]]
                    servers[name] = Server(
                        args.model, flags + ["--log-level", args.log_level], logs, name,
                        envs.get(mode, {}),
                    )
            if args.prime:
                for n in progress(args.concurrency, desc="priming"):
                    for server in servers.values():
                        wave(server, n, -2, args.max_tokens, args.prompt_words)
            primed = datetime.datetime.now()
            results = {}
            for n in args.concurrency:
                for server in servers.values():  # warm the caches and shapes
                    wave(server, n, -1, args.max_tokens, args.prompt_words)
                waves = {name: [] for name in servers}
                for w in progress(range(args.waves), desc=f"N={n}"):
                    order = list(servers) if w % 2 == 0 else list(servers)[::-1]
                    for name in order:
                        waves[name].append(
                            wave(servers[name], n, w, args.max_tokens, args.prompt_words, args.sustain)
                        )
                results[n] = pool_servers(waves, args.modes, args.servers)
                report(n, results[n])
                if args.json:  # after each N, so a run cut short keeps what it measured
                    Path(args.json).write_text(
                        json.dumps(
                            {"args": vars(args), "results": {str(k): v for k, v in results.items()}},
                            indent=1,
                        )
                    )
        finally:
            for server in servers.values():
                server.stop()
        load = {name: load_parts(server.log, primed) for name, server in servers.items()}
        for name, parts in load.items():
            if parts:
                print(f"{name}: next() by part after priming: " + ", ".join(
                    f"{kind} {n} x {1000 * seconds / n:.1f} ms" for kind, (n, seconds) in parts.items()
                ))
        if args.json and any(load.values()):
            written = json.loads(Path(args.json).read_text())
            written["load"] = {name: parts for name, parts in load.items() if parts}
            Path(args.json).write_text(json.dumps(written, indent=1))


def server_name(mode: str, index: int, count: int) -> str:
    return mode if count == 1 else f"{mode}.{index + 1}"


def pool_servers(waves: dict, modes, count: int) -> dict:
    """Each mode's waves pooled over its server processes, with each
    process's own aggregate rate beside them (``server_tps``) and each
    stall's process named (``server``)."""
    by_mode = {}
    for mode in modes:
        names = [server_name(mode, i, count) for i in range(count)]
        by_mode[mode] = summarise([w for name in names for w in waves[name]])
        per_server = {name: summarise(waves[name]) for name in names}
        by_mode[mode]["server_tps"] = [r["aggregate_tps"] for r in per_server.values()]
        by_mode[mode]["stalls"] = [
            dict(stall, server=name) for name, r in per_server.items() for stall in r["stalls"]
        ]
    return by_mode


def measure_costs(args, log: Path, env: dict) -> None:
    """The round costs the batched servers' ``cost`` policy reads, measured
    ahead (``mlx_dspark costs``, under the servers' environment ``env``) for
    every batch size of two's powers up to the largest N and the requests'
    whole context, as a server that has served before has them (it
    otherwise measures them over its first rounds at each size, in the
    measured waves)."""
    largest = max(args.concurrency)
    batches = [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]
    # Chat-template tokens come on top of the prompt's words.
    context = args.prompt_words + args.max_tokens + 64
    subprocess.run(
        [
            sys.executable, "-m", "mlx_dspark.batching.measure",
            "--model", str(args.model), "--draft-model", str(args.draft_model),
            "--batch", *map(str, batches), "--context", str(context),
        ],
        stdout=log.open("w"), stderr=subprocess.STDOUT, check=True, env={**os.environ, **env},
    )


# A part of the batch generator's DEBUG load line: "rounds 32% (147 x 22 ms)".
LOAD_PART = re.compile(r"([a-z][a-z ]*?) \d+% \((\d+) x (\d+) ms\)")
# Its split of every round: "a round: building 9.1 ms, waiting for the
# device 30.2 ms, reading 2.0 ms (mean of 31)".
ROUND_SPLIT = re.compile(
    r"a round: building ([\d.]+) ms, waiting for the device ([\d.]+) ms, "
    r"reading ([\d.]+) ms \(mean of (\d+)\)"
)


def load_parts(log: Path, since: datetime.datetime) -> dict:
    """``{part: (count, seconds)}`` of ``next()`` from a server's DEBUG load
    lines logged after ``since`` (``integration.batch.ServerBatchGenerator``,
    one every 10 s while busy, means in whole ms; the last part of a window
    is not logged): rounds of their own apart from rounds that also copied
    or handed back caches, prefill, first steps, measuring costs; and every
    round split into building, waiting for the device and reading. Lines
    logged during ``--prime`` are left out: its first uses of shapes
    compile kernels for seconds on MLX-CUDA. Empty without them."""
    parts = {}
    for line in log.read_text(errors="replace").splitlines():
        if "Batch generator, last" not in line:
            continue
        logged = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        if logged < since:
            continue
        inside = line.split("in next() (", 1)[-1]
        found = [(kind.strip(), int(count), float(ms)) for kind, count, ms in LOAD_PART.findall(inside)]
        split = ROUND_SPLIT.search(line)
        if split:
            build, wait, read, count = split.groups()
            for kind, ms in (("a round: building", build), ("waiting", wait), ("reading", read)):
                found.append((kind, int(count), float(ms)))
        for kind, count, ms in found:
            n, seconds = parts.get(kind, (0, 0.0))
            parts[kind] = (n + count, seconds + count * ms / 1000)
    return parts


def wave_ratios(result, stock):
    """Each wave's aggregate rate against stock's wave of the same index
    (the two ran next to each other): how much one wave's ratio moves."""
    return [a / b for a, b in zip(result["wave_tps"], stock["wave_tps"])]


def report(n, by_mode):
    stock = by_mode.get("stock", {})
    for mode, r in by_mode.items():
        ratio, spread = "    -", ""
        if stock:
            ratio = f"{r['aggregate_tps'] / stock['aggregate_tps']:5.2f}x"
            waves = wave_ratios(r, stock)
            spread = f", waves {min(waves):.2f}-{max(waves):.2f}x" if len(waves) > 1 else ""
            if len(r["server_tps"]) > 1:
                spread += ", servers " + " ".join(
                    f"{tps / stock['aggregate_tps']:.2f}x" for tps in r["server_tps"]
                )
        print(
            f"N={n:<3} {mode:<14} aggregate {r['aggregate_tps']:8.1f} tok/s ({ratio}{spread})  "
            f"per request {r['per_request_tps']:7.1f} tok/s  "
            f"TTFT p50 {1000 * r['ttft_p50']:7.1f} ms  p95 {1000 * r['ttft_p95']:7.1f} ms  "
            f"(response started after p50 {1000 * r['headers_p50']:6.1f} ms  p95 {1000 * r['headers_p95']:6.1f} ms)",
            flush=True,
        )
        for stall in r["stalls"]:
            ended = time.strftime("%H:%M:%S", time.localtime(stall["ended"]))
            print(
                f"      {stall['server']}: request {stall['request']} of wave {stall['wave']} waited "
                f"{stall['seconds']:.1f} s for a chunk, until {ended}",
                flush=True,
            )


if __name__ == "__main__":
    main()
