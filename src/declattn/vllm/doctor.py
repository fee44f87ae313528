"""``declattn doctor``: what DA will really do on this vLLM install, for one model.

A number from the plugin is worth believing only if the kernel really read the compacted
table. Which runner vLLM picks, which attention backend each KV-cache group gets, and the
CUDA-graph mode are decided at start-up from the install, the hardware and the flags, so
the doctor starts the engine with the flags the user will serve with and asks its
workers, not the docs:

1. a probe: one short DA request, teacher-forced into focus on one chunk of five;
2. per worker: the model runner (V1 or V2), each KV-cache group's backend and builder,
   the verdict for it (``support.group_verdict``), the engine's blockers and notes, and
   what the probe's read log shows per group: blocks handed to the kernel against the
   blocks the sequence had.

It ends with one line: DA active (and seen so by the probe), or why not, with the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from declattn.vllm import link, support

PROBE_LABEL = "declattn-doctor-probe"
PROBE_QUESTION = "Which colour is the door of the third house?"
PROBE_CONTEXT = "\n\n".join(
    f"House {i} stands on the hill road. Its door is painted {colour}, its garden holds "
    f"{i + 2} apple trees, and its keeper counts the carts that pass each morning. " * 6
    for i, colour in enumerate(("red", "green", "blue", "amber", "white"), start=1)
)
PROBE_FORCED = '<focus magic_chunks="3">\nThe door'


@dataclass
class GroupLine:
    """One KV-cache group of one worker, and what the probe's steps read in it."""

    kv_cache_group: int
    backend: str
    builder: str
    layers: int
    spec: str
    block_size: int
    ok: bool
    reason: str
    fix: str
    by_design: bool
    probe_steps: int = 0
    probe_blocks_read: int = 0
    probe_blocks_full: int = 0


@dataclass
class WorkerReport:
    rank: int
    runner: str
    processor: bool  # a DA logits processor runs in this worker's engine
    cudagraph_mode: str
    async_scheduling: bool
    tensor_parallel: int
    groups: list[GroupLine]
    blockers: list[dict[str, str]]
    notes: list[str]
    probe: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        """Every group DA should restrict was restricted at every probe step."""
        live = [g for g in self.groups if g.ok]
        return (self.processor and not self.blockers and bool(live)
                and self.probe is not None and self.probe.get("reads_restricted") is True
                and all(0 < g.probe_steps and g.probe_blocks_read < g.probe_blocks_full
                        for g in live))


@dataclass
class DoctorReport:
    vllm: str
    model: str
    settings: dict[str, Any]
    workers: list[WorkerReport] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.workers) and all(w.active for w in self.workers)

    def verdict(self) -> str:
        if self.active:
            return ("DA active: at every probe step the kernel was handed fewer blocks "
                    "than the sequence has, in every full-attention group")
        causes: list[str] = []
        for w in self.workers:
            if not w.processor:
                causes.append("no DA logits processor in this engine (declattn not "
                              "installed in vLLM's environment, or VLLM_PLUGINS excludes it)")
            causes += [f"{b['reason']}; fix: {b['fix']}" for b in w.blockers]
            causes += [f"group {g.kv_cache_group} ({g.backend}): {g.reason}"
                       + (f"; fix: {g.fix}" if g.fix else "")
                       for g in w.groups if not g.ok and not g.by_design]
            if not any(g.ok for g in w.groups):
                causes.append("no full-attention group to restrict")
            if not causes and w.probe is None:
                causes.append("the probe did not run (--no-probe)")
            elif not causes:
                causes.append(f"the probe's reads were not restricted: {w.probe}")
        return "DA will NOT skip here: " + " | ".join(dict.fromkeys(causes))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["active"] = self.active
        d["verdict"] = self.verdict()
        return d


# -- run in each worker (through ``LLM.collective_rpc``) --------------------------------
def inspect_worker(worker: Any, label: str | None = None) -> dict[str, Any]:
    """The worker's runner, groups, verdicts and (``label``) the probe's reads, as plain
    data: it crosses a process boundary under tensor parallelism."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    runner = worker.model_runner
    config = worker.vllm_config
    kind = support.V2 if isinstance(runner, V2Runner) else support.V1
    host = link.lookup(config)
    report = None
    if host is not None and label is not None:
        try:
            report = host.state.report(label)
        except KeyError:
            report = None
    groups = []
    for per_group in runner.attn_groups:
        for g in per_group:
            builder = g.get_metadata_builder(0)
            verdict = support.group_verdict(builder)
            line = GroupLine(
                kv_cache_group=g.kv_cache_group_id, backend=g.backend.get_name(),
                builder=type(builder).__name__, layers=len(g.layer_names),
                spec=type(g.kv_cache_spec).__name__,
                block_size=int(builder.kv_cache_spec.block_size), ok=verdict.ok,
                reason=verdict.reason, fix=verdict.fix, by_design=verdict.by_design)
            info = host.state.groups.get(id(builder)) if host is not None else None
            if report is not None and info is not None:
                mine = [r for r in report.reads if r.group == info.index]
                line.probe_steps = len(mine)
                line.probe_blocks_read = sum(len(r.logical) for r in mine)
                line.probe_blocks_full = sum(-(-r.length // line.block_size) for r in mine)
            groups.append(asdict(line))
    cc = config.compilation_config
    return {
        "rank": int(getattr(worker, "rank", 0)),
        "runner": kind,
        "processor": host is not None,
        "cudagraph_mode": cc.cudagraph_mode.name if cc.cudagraph_mode is not None else "NONE",
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "tensor_parallel": int(config.parallel_config.tensor_parallel_size),
        "groups": groups,
        "blockers": [{"reason": b.reason, "fix": b.fix}
                     for b in support.engine_blockers(config, kind)],
        "notes": support.engine_notes(config, kind),
        "probe": None if report is None else report.to_dict(),
    }


# -- the command ---------------------------------------------------------------------
def run_doctor(model: str, settings: dict[str, Any], *, probe: bool = True) -> DoctorReport:
    """Start vLLM on ``model`` with ``settings`` (``vllm.LLM`` keyword arguments), run
    the probe, and inspect every worker."""
    import vllm

    from declattn.da.options import DAOptions
    from declattn.vllm.offline import offline_env, served_model
    from declattn.vllm.request import build_request

    offline_env()
    served = served_model(model)
    llm = vllm.LLM(model=str(served.directory), **settings)
    label = None
    if probe:
        tok = served.tokenizer
        force = tok.encode(PROBE_FORCED, add_special_tokens=False)
        req = build_request(PROBE_CONTEXT, PROBE_QUESTION, tok,
                            DAOptions(target=96, cap=160), force=force, label=PROBE_LABEL)
        params = req.sampling_params(max_tokens=len(force) + 8, stop=[], ignore_eos=True)
        llm.generate([req.prompt()], [params], use_tqdm=False)
        label = PROBE_LABEL
    report = DoctorReport(vllm.__version__, str(served.directory), dict(settings))
    for info in llm.collective_rpc(inspect_worker, args=(label,)):
        groups = [GroupLine(**g) for g in info.pop("groups")]
        report.workers.append(WorkerReport(groups=groups, **info))
    return report
