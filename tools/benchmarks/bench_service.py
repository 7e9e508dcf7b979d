"""Datastore service benchmark: propose over loopback HTTP beside the in-process retriever, same run.

For each concurrency (1, 8, 32 client processes, closed loop: each sends its next request when the last
is answered) and each request shape (one context, or a batch of 8 contexts), the clients are, in rounds
that alternate A B C D (a balanced order every round, after a warm-up of each):
  inproc       each client process proposes from its own in-process Retriever (the baseline)
  binary       RemoteRetriever, raw little-endian arrays (the client default)
  json         RemoteRetriever, JSON bodies
  httpx        httpx.Client posting the same binary bodies (single contexts only), to justify the client
  floor        RemoteRetriever against the HTTP stack alone: uvicorn with the service's protocol, answering
               every propose with the same typical tree (single contexts only). Its CPU per request is the
               floor under the service's; the difference is the service's own work.
Reported per cell: requests/s, contexts/s and p50/p99/min/max latency, as the median over rounds (and the
min/max of each over rounds), and where the time goes per request: client CPU and service CPU (user and
system, from os.times and /proc) and the service's own handling time (its /metrics latency histogram:
request head parsed, or body read, to response handed to the transport); and how many cores other
processes kept busy meanwhile (/proc/stat minus the clients and the service): on a shared machine a
number measured beside 1 busy core of someone else's is not one measured on 2 free cores. Clients are
processes, not threads: threads would measure their own GIL. Every process pins its thread pools to one
thread; the service is one uvicorn process.
--think-ms makes each client pause between answers, as a TTS worker running its model forward does.

Also measured: encode + decode cost per propose, JSON vs binary, at 100/500/2000-token contexts (no
network), and with --profile a py-spy sample of the service under 8 clients, grouped by component
(py-spy sees Python frames only, and samples wall time: time inside uvloop's C code and the kernel,
and time spent preempted there, is charged to the last Python line that ran, mostly the response's
transport.write, which wakes the client).

    python -m echospec.tools.benchmarks.bench_service --out bench/service           # ~5 minutes
    python -m echospec.tools.benchmarks.bench_service --think-ms 5 --modes inproc,binary --batch 1 --no-profile
    python -m echospec.tools.benchmarks.bench_service --store my_store --rounds 5 --seconds 3 --profile
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click
import numpy as np

from ...datastore.files import atomic_file
from ..bench.harness import balanced_order, pin_threads
from ..bench.machine import machine
from ..commands import out_option
from .support.service_servers import free_port, start_floor, start_service

THREADS = 1  # per process: the clients, the service and this one
MODES = ("inproc", "binary", "json", "httpx", "floor")
SINGLE_ONLY = ("httpx", "floor")  # modes measured for one-context requests only
WARMUP_CALLS = 200


# ---------------------------------------------------------------------------------------------------
# Clients (each in its own process)


def make_client(mode: str, url: str, store_name: str, store_dir: str):
    """A callable proposing a list of (context, speaker) pairs in one request (or in-process call)."""
    if mode == "inproc":
        from ...retriever import Retriever

        retriever = Retriever(store_dir)
        return lambda batch: [retriever.propose(c, speaker=s) for c, s in batch]
    if mode == "httpx":
        import httpx

        from ...retriever.client.wire import BINARY, decode_trees, encode_contexts

        client = httpx.Client(timeout=10.0)
        endpoint = f"{url}/v1/stores/{store_name}/propose"

        def call(batch):
            answer = client.post(endpoint, params={"speaker": batch[0][1]} if batch[0][1] else None,
                                 content=encode_contexts([c for c, _ in batch]), headers={"Content-Type": BINARY})
            answer.raise_for_status()
            return decode_trees(answer.content)

        return call
    from ...retriever.client import RemoteRetriever

    remote = RemoteRetriever(url, store=store_name, timeout=10.0, payload=mode)
    return lambda batch: remote.propose_batch([c for c, _ in batch], speaker=batch[0][1])


def client_process(mode, url, store_name, store_dir, requests, seconds, think, barrier, results) -> None:
    call = make_client(mode, url, store_name, store_dir)
    for i in range(WARMUP_CALLS):
        call(requests[i % len(requests)])
    barrier.wait()
    latencies, i = [], 0
    clock = time.perf_counter
    cpu = os.times()
    end = clock() + seconds
    while (start := clock()) < end:
        call(requests[i % len(requests)])
        latencies.append(clock() - start)
        i += 1
        if think:
            time.sleep(think)  # a TTS worker's model forward between two proposals
    after = os.times()
    results.put((np.array(latencies), after.user - cpu.user, after.system - cpu.system))


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def machine_cpu() -> float:
    """CPU seconds used so far by everything on this machine, all cores together (/proc/stat; steal, the
    time the hypervisor gave our cores to someone else, included)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in Path("/proc/stat").read_text()
                                                               .split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_cell(mode, clients, requests_per_client, url, store_name, store_dir, seconds, server_pid, think=0.0) -> dict:
    ctx = mp.get_context("fork")  # the parent has loaded everything already; no threads are running
    barrier, results = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=client_process, args=(mode, url, store_name, store_dir, requests_per_client[k],
                                                      seconds, think, barrier, results)) for k in range(clients)]
    for p in procs:
        p.start()
    barrier.wait()
    started, server_before, app_before = time.perf_counter(), process_cpu(server_pid), app_seconds(url)
    machine_before = machine_cpu()
    answers = [results.get(timeout=seconds + 120) for _ in procs]
    elapsed, server_after, app_after = time.perf_counter() - started, process_cpu(server_pid), app_seconds(url)
    machine_after = machine_cpu()
    for p in procs:
        p.join()
    latencies = np.concatenate([a[0] for a in answers])
    n, batch = len(latencies), len(requests_per_client[0][0])
    per_request = lambda seconds_: seconds_ / n * 1e6  # noqa: E731
    return {"requests_per_s": n / max(elapsed, seconds), "contexts_per_s": batch * n / max(elapsed, seconds),
            "p50_ms": float(np.percentile(latencies, 50)) * 1e3, "p99_ms": float(np.percentile(latencies, 99)) * 1e3,
            "min_ms": float(latencies.min()) * 1e3, "max_ms": float(latencies.max()) * 1e3, "n": n,
            "client_user_us": per_request(sum(a[1] for a in answers)),
            "client_system_us": per_request(sum(a[2] for a in answers)),
            "server_user_us": per_request(server_after[0] - server_before[0]) if mode != "inproc" else 0.0,
            "server_system_us": per_request(server_after[1] - server_before[1]) if mode != "inproc" else 0.0,
            "server_app_us": (app_after[0] - app_before[0]) / max(app_after[1] - app_before[1], 1) * 1e6,
            "other_cores": max(0.0, machine_after - machine_before - sum(a[1] + a[2] for a in answers)
                               - sum(server_after) + sum(server_before)) / elapsed}


def app_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the service's own propose handling time (its latency histogram: body read to
    response handed to uvicorn), from /metrics."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in text.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f'echospec_request_seconds_{key}{{endpoint="propose"}}'):
                values[key] = float(line.split()[-1])
    return values.get("sum", 0.0), values.get("count", 0.0)


# ---------------------------------------------------------------------------------------------------
# Where the time goes: py-spy samples of the service, grouped

CATEGORIES = (  # first match wins, checked from the innermost frame outwards
    ("response write: loopback send, waking the client (and waiting while it runs)",
     ("_HeldWrites.flush", "ServiceHttpProtocol.on_message_complete")),
    ("retriever: propose (numba kernels, tree)", ("retriever/retriever.py", "retriever/tree.py")),
    ("wire: decode contexts / encode trees", ("retriever/client/wire.py",)),
    ("metrics (prometheus_client)", ("prometheus_client", "Metrics.")),
    ("uvicorn + httptools: HTTP parsing, response", ("uvicorn/", "httptools", "_OneWriteCycle", "HttpToolsProtocol",
                                                      "ServiceHttpProtocol")),
    ("service: routing, body, validation", ("retriever/service",)),
    ("event loop (uvloop/asyncio), socket I/O", ("uvloop", "asyncio/", "selectors")),
)


def profile_service(pid: int, seconds: float, out: Path) -> dict:
    raw = out / "service_profile.txt"
    subprocess.run(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "1000",
                    "--format", "raw", "--nonblocking", "--output", str(raw)], check=True, capture_output=True)
    groups, leaves, total = Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        total += n
        leaves[frames[-1]] += n
        groups[next((name for frame in reversed(frames) for name, keys in CATEGORIES
                     if any(k in frame for k in keys)), "other")] += n
    return {"samples": total, "share": {k: round(v / total, 3) for k, v in groups.most_common()},
            "top_leaf_functions": [(k, round(v / total, 3)) for k, v in leaves.most_common(12)]}


# ---------------------------------------------------------------------------------------------------


def codec_costs(store_dir: str, utterances: list[dict], lengths=(100, 500, 2000), rounds: int = 5) -> dict:
    """Microseconds per single propose spent encoding and decoding, both ends, JSON vs binary: the part
    of the payload choice that the network does not blur. Alternates A B per round; medians."""
    import timeit

    from ...retriever import CandidateTree, Retriever
    from ...retriever.service import ProposeRequest
    from ...retriever.client.wire import decode_contexts, decode_trees, encode_contexts, encode_trees

    retriever = Retriever(store_dir)
    stream = np.concatenate([np.array(u["tokens"], np.int64) for u in utterances[:2000]])
    out = {}
    for n in lengths:
        context = stream[:n]
        tree = retriever.propose(context)

        def binary(context=context, tree=tree):
            received = decode_contexts(encode_contexts([context]), 1)  # client -> service
            return decode_trees(encode_trees([tree] * len(received)))  # service -> client

        def as_json(context=context, tree=tree):
            request = ProposeRequest.model_validate_json(json.dumps({"context": context.tolist()}))
            np.array(request.context, np.int64)
            answer = json.dumps({"tree": tree.to_dict()}, separators=(",", ":"))
            return CandidateTree.from_dict(json.loads(answer)["tree"])

        runs = {"binary": [], "json": []}
        for _ in range(rounds):
            for name, fn in (("binary", binary), ("json", as_json)):
                number = 200
                runs[name].append(min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6)
        out[f"context{n}"] = {name: {"median_us": float(np.median(v)), "min_us": float(min(v)),
                                     "max_us": float(max(v))} for name, v in runs.items()}
        out[f"context{n}"]["json_over_binary"] = out[f"context{n}"]["json"]["median_us"] / \
            out[f"context{n}"]["binary"]["median_us"]
    return out


def mean_context_tokens(utterances: list[dict]) -> float:
    return float(np.mean([len(c) for r in make_requests(utterances, 200, 1, seed=0) for c, _ in r]))


def make_requests(corpus: list[dict], n: int, batch: int, seed: int) -> list[list[tuple[np.ndarray, str]]]:
    """`n` requests of `batch` (context, speaker) pairs cut from corpus utterances (one speaker a request)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        utt = corpus[int(rng.integers(len(corpus)))]
        speaker = utt["speaker"]
        same = [u for u in corpus[:400] if u["speaker"] == speaker] or [utt]
        pairs = []
        for j in range(batch):
            u = utt if j == 0 else same[int(rng.integers(len(same)))]
            cut = int(rng.integers(min(20, len(u["tokens"]) - 1), len(u["tokens"])))
            pairs.append((np.array(u["tokens"][:cut], np.int64), speaker))
        out.append(pairs)
    return out


@click.command()
@click.option("--store", "store_dir", type=click.Path(exists=True, file_okay=False),
              help="A datastore (default: build one from a synthetic speech-like corpus).")
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False),
              help="JSONL the contexts are cut from (default: the synthetic corpus).")
@click.option("--tokens", default=1_000_000, show_default=True, help="Size of the synthetic corpus.")
@click.option("--clients", "concurrency", default="1,8,32", show_default=True)
@click.option("--batch", "batches", default="1,8", show_default=True, help="Contexts per request.")
@click.option("--modes", default=",".join(MODES), show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--seconds", default=2.0, show_default=True, help="Measured seconds per cell and round.")
@click.option("--think-ms", default=0.0, show_default=True,
              help="Pause after each answer (a model forward); 0 = closed loop, every client saturating.")
@click.option("--profile/--no-profile", default=True, show_default=True, help="py-spy breakdown of the service.")
@out_option("bench/service")
def main(store_dir, corpus, tokens, concurrency, batches, modes, rounds, seconds, think_ms, profile, out_dir) -> None:
    """Requests/s and p50/p99 propose latency, in-process vs over loopback HTTP."""
    from ...datastore import build
    from ..corpus.synth_corpus import SynthConfig, generate, write_jsonl

    pin_threads(THREADS)
    load_at_start = os.getloadavg()  # other work on the machine skews every number: say how much there was
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-service-"))
    try:
        if store_dir is None or corpus is None:
            write_jsonl(generate(SynthConfig(n_tokens=tokens, n_speakers=8, seed=0)), tmp / "corpus.jsonl")
            corpus = corpus or tmp / "corpus.jsonl"
            if store_dir is None:
                store_dir = tmp / "store"
                build(tmp / "corpus.jsonl", store_dir, faiss=False, progress=False)
        utterances = [json.loads(line) for line in open(corpus)]
        port = free_port()
        service = start_service(Path(store_dir), "bench", port)
        url = f"http://127.0.0.1:{port}"
        try:
            report = run(url, service.pid, str(store_dir), utterances, concurrency, batches, modes, rounds, seconds,
                         think_ms / 1e3)
            report["codec"] = codec_costs(str(store_dir), utterances)
            if profile and shutil.which("py-spy"):
                report["profile"] = profile_under_load(service.pid, url, str(store_dir), utterances, seconds, out)
        finally:
            service.send_signal(signal.SIGTERM)
            service.wait(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["machine"] = machine(threads_per_process=THREADS)
    report["setup"] = {"load_average_at_start": load_at_start, "load_average_at_end": report["machine"]["load_average"],
                       "rounds": rounds, "seconds_per_cell": seconds,
                       "think_ms": think_ms, "mean_context_tokens": mean_context_tokens(utterances)}
    with atomic_file(out / f"service{'_think' if think_ms else ''}.json") as f:
        json.dump(report, f, indent=1)
    print_report(report)


def run(url, server_pid, store_dir, utterances, concurrency, batches, modes, rounds, seconds, think) -> dict:
    concurrency = [int(c) for c in concurrency.split(",")]
    batches = [int(b) for b in batches.split(",")]
    modes = [m for m in modes.split(",") if m]
    targets = {m: (url, server_pid) for m in modes}  # mode: (url, pid) of the server it measures
    floor = None
    if "floor" in modes and 1 in batches:
        port = free_port()
        floor = start_floor(store_dir, make_requests(utterances, 1, 1, seed=0)[0][0], port)
        targets["floor"] = (f"http://127.0.0.1:{port}", floor.pid)
    try:
        return {"cells": run_cells(targets, store_dir, utterances, concurrency, batches, modes, rounds, seconds,
                                   think)}
    finally:
        if floor is not None:
            floor.terminate()
            floor.join(10)


def run_cells(targets, store_dir, utterances, concurrency, batches, modes, rounds, seconds, think) -> dict:
    cells = {}
    for batch in batches:
        for clients in concurrency:
            requests = [make_requests(utterances, 200, batch, seed=1000 * batch + k) for k in range(clients)]
            cell_modes = [m for m in modes if not (m in SINGLE_ONLY and batch > 1)]
            runs = {m: [] for m in cell_modes}
            for r in range(rounds):
                for mode in balanced_order(cell_modes, r):
                    url, pid = targets[mode]
                    runs[mode].append(run_cell("binary" if mode == "floor" else mode, clients, requests, url, "bench",
                                               store_dir, seconds, pid, think))
                    print(f"batch {batch} clients {clients:2d} {mode:7s} round {r}: "
                          f"{runs[mode][-1]['requests_per_s']:8.0f} req/s  p50 {runs[mode][-1]['p50_ms']:.3f} ms  "
                          f"p99 {runs[mode][-1]['p99_ms']:.3f} ms", file=sys.stderr)
            for mode, results in runs.items():
                cells[f"batch{batch}/clients{clients}/{mode}"] = summarize(results)
    return cells


def summarize(results: list[dict]) -> dict:
    out = {}
    for key in ("requests_per_s", "contexts_per_s", "p50_ms", "p99_ms"):
        values = [r[key] for r in results]
        out[key] = {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}
    for key in ("client_user_us", "client_system_us", "server_user_us", "server_system_us", "server_app_us",
                "other_cores"):
        out[key] = float(np.median([r[key] for r in results]))
    out["min_ms"] = min(r["min_ms"] for r in results)
    out["max_ms"] = max(r["max_ms"] for r in results)
    return out


def profile_under_load(pid, url, store_dir, utterances, seconds, out) -> dict:
    """8 clients, single binary proposals, while py-spy samples the service."""
    requests = [make_requests(utterances, 200, 1, seed=77 + k) for k in range(8)]
    ctx = mp.get_context("fork")
    load = ctx.Process(target=run_cell, args=("binary", 8, requests, url, "bench", store_dir, seconds + 6, pid))
    load.start()
    time.sleep(3)  # clients warmed up and sending
    try:
        return profile_service(pid, seconds + 1, out)
    finally:
        load.join()


def print_report(report: dict) -> None:
    print(f"{'cell':30s} {'req/s':>7s} {'ctx/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'p99 min..max':>13s}"
          f"   us/request: client CPU user+sys, service CPU user+sys, service app time;  cores busy with other work")
    for name, cell in report["cells"].items():
        print(f"{name:30s} {cell['requests_per_s']['median']:7.0f} {cell['contexts_per_s']['median']:7.0f} "
              f"{cell['p50_ms']['median']:7.3f} {cell['p99_ms']['median']:7.3f} "
              f"{cell['p99_ms']['min']:6.2f}..{cell['p99_ms']['max']:<6.2f}"
              f"   {cell['client_user_us']:5.0f}+{cell['client_system_us']:<5.0f} "
              f"{cell['server_user_us']:5.0f}+{cell['server_system_us']:<5.0f} {cell['server_app_us']:5.0f}"
              f"  {cell.get('other_cores', float('nan')):5.2f}")
    for name, cell in report["cells"].items():
        floor = report["cells"].get(name.replace("/binary", "/floor")) if name.endswith("/binary") else None
        if floor:
            service, stack = (c["server_user_us"] + c["server_system_us"] for c in (cell, floor))
            print(f"{name.rpartition('/')[0]}: service CPU {service:.0f} us/request = {stack:.0f} HTTP stack (floor) + "
                  f"{service - stack:.0f} the service's own work; client CPU {cell['client_user_us']:.0f}+"
                  f"{cell['client_system_us']:.0f} us (against the floor {floor['client_user_us']:.0f}+"
                  f"{floor['client_system_us']:.0f})")
    print("\nencode + decode, both ends, per single propose (us, median; no network):")
    for name, cell in report["codec"].items():
        print(f"  {name:12s} binary {cell['binary']['median_us']:7.1f}   json {cell['json']['median_us']:7.1f}"
              f"   json/binary {cell['json_over_binary']:.1f}x")
    if "profile" in report:
        print("\nwhere the service's time goes (py-spy, 8 clients, single binary proposals):")
        for name, share in report["profile"]["share"].items():
            print(f"  {share:6.1%}  {name}")
    setup = report["setup"]
    print(f"\nthink time {setup['think_ms']} ms; mean context {setup['mean_context_tokens']:.0f} tokens; load average "
          f"(1, 5, 15 min) at the start: {_loads(setup['load_average_at_start'])}, at the end: "
          f"{_loads(setup['load_average_at_end'])}")


def _loads(loads) -> str:
    return ", ".join(f"{x:.2f}" for x in loads)


if __name__ == "__main__":
    main()
