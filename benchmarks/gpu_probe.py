"""Run fairseq-generate in this process, once per entry of a plan, and measure each decoding.

    python benchmarks/gpu_probe.py PLAN.json

The GPU scripts (``gpu_check.py``, ``gpu_bench.py``) start this as a child
process with a time limit. PLAN.json is ``{"runs": [{"name", "argv",
"results", "result"}, ...]}``: ``argv`` is a fairseq-generate command line
without the program name, ``results`` the ``--results-path`` folder its
output goes to, ``result`` the JSON file written when the run ends. A run
whose ``result`` exists is skipped, so the parent can start the probe again
after one run killed it (a crash, a hang) and the others still run. Before a
run starts its name goes to ``PLAN.json.current``.

Measured per run, with nothing added to the decoding loop but a clock read
per decoder call:

* ``calls``/``rows``: decoder calls and hypotheses expanded, counted where
  our searches count them (``DecodeStats.add_step``) and, for fairseq's own
  ``SequenceGenerator``, at ``EnsembleModel.forward_decoder``;
* ``host_ms_per_call``: the median time between the starts of consecutive
  decoder calls, without any synchronization: on a GPU the host's time per
  call (a forward and the search update after it), which is the wall clock
  per call when the GPU is not the bottleneck; ``ms_per_call`` is the
  decoding seconds over the calls, batch starts and encoder included;
* ``decode_s``: fairseq's own "Translated N sentences ... in X s" (as N over
  its sentences per second, which has more digits);
* ``gpu_busy``: the mean of ``torch.cuda.utilization()`` (NVML: the share of
  the last sample period, 1/6 s to 1 s, in which a kernel ran) sampled every
  50 ms between the first and the last decoder call; needs pynvml
  (nvidia-ml-py); coarse for runs under a second;
* ``peak_mib``/``peak_reserved_mib``: ``torch.cuda.max_memory_allocated``
  and ``max_memory_reserved`` over the run (model weights included);
* ``cold_decode_s``: with the plan's ``"warm_up": true`` (gpu_bench's on a
  GPU), each run is decoded twice in a row and the second is measured: the
  first pays what a process pays once per shape (cuDNN's fp16 attention plans,
  cuBLAS's handles, the allocator's growth: fairseq's beam, first in a plan,
  took 3.76 s on an H200 for three steps a batch), which a short benchmark
  would otherwise charge to whichever method meets a shape first; its
  decoding time is kept here. Each run's own work (a runner's CUDA graphs,
  its caches) is built again in the measured decode;
* ``models_kept``: with the plan's ``"keep_models": true`` (gpu_bench's),
  the members are loaded once per checkpoint list and precision and kept for
  the plan's later runs (loading four WMT-sized members took 13-17 s a run on
  an H200, longer than most decodes): such a run's ``process_s`` leaves the
  loading out, and ``models_kept`` says so.
* ``kernels``: with the plan's ``"profile": {"first": F, "calls": C}`` and a
  warm-up, torch.profiler records decoder calls F to F+C of the untimed
  warm-up decode (``gpu_kernels.py``): the kernels' device time per call by
  kind (products, softmax/attention, moves, top-k, ours, ...), launches per call and
  the costliest kernels; ``null`` where the decode made fewer calls. The
  measured decode runs without the profiler.

On the CPU the GPU figures are ``null`` (and ``kernels`` totals the ATen
operators' CPU time).
"""

import json
import logging
import os
import re
import statistics
import sys
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fairseq-generate's closing line; N / (sentences per second) has more digits than its rounded seconds.
TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s \(([\d.]+) sentences/s")
SAMPLE_S = 0.05


class CallLog:
    """Clock and rows at every decoder call: ours (``DecodeStats.add_step``) and fairseq's generator's."""

    def __init__(self):
        self.ours, self.fairseq = [], []
        self.listener = None  # called with (counting point, call index) at each call: a KernelWindow's

    def install(self):
        """Wrap the two counting points at class level (every decoder built later is counted)."""
        from fairseq.sequence_generator import EnsembleModel

        from fairseq_stream.stats import DecodeStats

        log = self
        add_step, forward_decoder = DecodeStats.add_step, EnsembleModel.forward_decoder

        def counted_add_step(stats, length, rows, seconds):
            log.ours.append((time.perf_counter(), rows))
            if log.listener:
                log.listener("ours", len(log.ours) - 1)
            return add_step(stats, length, rows, seconds)

        def counted_forward_decoder(model, tokens, *args, **kwargs):
            log.fairseq.append((time.perf_counter(), tokens.size(0)))
            if log.listener:
                log.listener("fairseq", len(log.fairseq) - 1)
            return forward_decoder(model, tokens, *args, **kwargs)

        DecodeStats.add_step = counted_add_step
        EnsembleModel.forward_decoder = counted_forward_decoder

    def reset(self):
        self.ours, self.fairseq = [], []

    def calls(self):
        """The run's calls: ours where our loop ran (our fairseq runner also calls forward_decoder)."""
        return self.ours or self.fairseq


class KeptModels:
    """fairseq-generate's ``load_model_ensemble``, loading each checkpoint list once for the plan's runs.

    A run gets the same member objects as the run before it with the same
    paths, overrides and precision flags (fairseq-generate then calls
    ``half()``, ``cuda()`` and ``prepare_for_inference_`` on them again, which
    change nothing the second time). Nothing else is kept: the task, the data
    and every runner's own weights are built again per run."""

    def __init__(self):
        self.kept, self.hit = {}, False

    def install(self):
        from fairseq import checkpoint_utils

        load = checkpoint_utils.load_model_ensemble
        kept = self

        def load_model_ensemble(filenames, *args, **kwargs):
            # sys.argv is the run's command line (measure sets it): a member halved by an --fp16 run must
            # not serve a float32 run, nor a CPU run's one a CUDA run.
            flags = tuple(flag for flag in ("--fp16", "--cpu", "--bf16") if flag in sys.argv)
            # The task is built anew per run (same data, same dictionaries): not part of the key.
            options = sorted((k, v) for k, v in kwargs.items() if k != "task")
            key = repr((list(filenames), args, options, flags))
            kept.hit = key in kept.kept
            if not kept.hit:
                kept.kept[key] = load(filenames, *args, **kwargs)
            models, cfg = kept.kept[key]
            return list(models), cfg

        checkpoint_utils.load_model_ensemble = load_model_ensemble


class Sampler(threading.Thread):
    """``torch.cuda.utilization()`` every 50 ms, with the time of each sample."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples, self.error = [], None
        self._stop_event = threading.Event()

    def run(self):
        import torch

        while not self._stop_event.is_set():
            try:
                self.samples.append((time.perf_counter(), torch.cuda.utilization()))
            except Exception as e:  # no pynvml, or NVML refuses: the figure is n/a, the run goes on
                self.error = "{}: {}".format(type(e).__name__, e)
                return
            self._stop_event.wait(SAMPLE_S)

    def stop(self):
        self._stop_event.set()
        self.join()


class LineCatcher(logging.Handler):
    """Keeps fairseq-generate's 'Translated ...' log line."""

    def __init__(self):
        super().__init__()
        self.translated = None

    def emit(self, record):
        match = TRANSLATED.search(record.getMessage())
        if match:
            self.translated = match


def measure(run, calls, cuda, kept=None, window=None):
    """Run one fairseq-generate command line; the result dict (``kept``: a :class:`KeptModels` in use;
    ``window``: a :class:`gpu_kernels.KernelWindow` to profile calls of this decode with)."""
    import torch
    from fairseq_cli import generate

    calls.reset()
    calls.listener = window.on_call if window is not None else None
    if kept is not None:
        kept.hit = False
    catcher = LineCatcher()
    logging.getLogger("fairseq_cli.generate").addHandler(catcher)
    sampler = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        sampler = Sampler()
        sampler.start()
    error = None
    start = time.perf_counter()
    sys.argv = ["fairseq-generate"] + run["argv"] + ["--results-path", run["results"]]
    try:
        generate.cli_main()
    except SystemExit as e:
        if e.code not in (None, 0):
            error = "exit {}".format(e.code)
    except Exception as e:  # a failing run is a result too; the next one still runs
        error = "{}: {}".format(type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        traceback.print_exc()
    finally:
        logging.getLogger("fairseq_cli.generate").removeHandler(catcher)
        calls.listener = None
        if window is not None:
            window.close()
    if cuda:
        torch.cuda.synchronize()
    process_s = time.perf_counter() - start
    stamps = calls.calls()
    result = {"name": run["name"], "error": error, "process_s": round(process_s, 3), "calls": len(stamps),
              "rows": sum(r for _, r in stamps)}
    result["rows_per_call"] = round(result["rows"] / len(stamps), 2) if stamps else None
    intervals = [t1 - t0 for (t0, _), (t1, _) in zip(stamps, stamps[1:])]
    result["host_ms_per_call"] = round(1000 * statistics.median(intervals), 4) if intervals else None
    match = catcher.translated
    if match:
        sentences, per_s = int(match.group(1).replace(",", "")), float(match.group(4))
        result["sentences"] = sentences
        result["decode_s"] = round(sentences / per_s, 4) if per_s > 0 else float(match.group(3))
    else:
        result["sentences"] = result["decode_s"] = None
    result["models_kept"] = bool(kept is not None and kept.hit)
    result["ms_per_call"] = (round(1000 * result["decode_s"] / len(stamps), 4)
                             if stamps and result["decode_s"] else None)
    result["gpu_busy"] = result["peak_mib"] = result["peak_reserved_mib"] = result["gpu_busy_note"] = None
    if cuda:
        sampler.stop()
        window = [u for t, u in sampler.samples if stamps and stamps[0][0] <= t <= stamps[-1][0]]
        if window:
            result["gpu_busy"] = round(statistics.mean(window) / 100, 3)
        result["gpu_busy_note"] = sampler.error or "{} NVML samples".format(len(window))
        result["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)
        result["peak_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2 ** 20, 1)
        torch.cuda.empty_cache()  # the next run's peak starts from its own allocations
    return result


def write_json(path, data):
    """Write JSON atomically: the parent never reads half a file."""
    tmp = "{}.tmp{}".format(path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: gpu_probe.py PLAN.json")
    with open(argv[0]) as f:
        plan = json.load(f)
    sys.path.insert(0, REPO)
    # fairseq-generate's basicConfig would send its log to the first run's stdout; stderr it is.
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO,
                        stream=sys.stderr)
    import torch

    import fairseq_stream  # noqa: F401  (safe checkpoint loading before any run)
    import gpu_kernels  # beside this script; imports torch

    cuda = plan.get("device", "cpu") == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("gpu_probe: the plan asks for cuda, but torch sees no CUDA device")
    if cuda and plan.get("profile"):
        # A graph captured before the process's first profiler, replayed under one, can fault
        # (pytorch#75504); torch's workaround: open and close a profiler before any capture.
        torch.profiler._utils._init_for_cuda_graphs()
    calls = CallLog()
    calls.install()
    kept = None
    if plan.get("keep_models"):
        kept = KeptModels()
        kept.install()
    for run in plan["runs"]:
        if os.path.exists(run["result"]):
            continue
        with open(argv[0] + ".current", "w") as f:
            f.write(run["name"])
        print("gpu_probe: {}: fairseq-generate {}".format(run["name"], " ".join(run["argv"])),
              file=sys.stderr, flush=True)
        os.makedirs(run["results"], exist_ok=True)
        window = None
        if plan.get("warm_up") and plan.get("profile"):
            window = gpu_kernels.KernelWindow(plan["profile"]["first"], plan["profile"]["calls"], cuda)
        cold = measure(run, calls, cuda, kept, window) if plan.get("warm_up") else None
        result = measure(run, calls, cuda, kept)
        if cold is not None:
            result["cold_decode_s"] = cold["decode_s"]
            result["error"] = result["error"] or cold["error"]
        if window is not None:
            result["kernels"] = window.summary
        write_json(run["result"], result)


if __name__ == "__main__":
    main()
