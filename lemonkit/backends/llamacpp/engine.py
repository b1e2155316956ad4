"""The llama.cpp engine: loads one GGUF and wires prompts, generation and response shapes to the OpenAI routes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from lemonkit.backends.chat import (
    FORMATS,
    ChatTemplate,
    ToolSpec,
    detect_format,
    formatter_by_name,
    merge_system_messages,
    normalize_messages,
    parse_tools,
    prompt_opens_thinking,
    response_format_grammar,
    tool_call_grammar,
    tool_system_prompt,
    with_system,
)
from lemonkit.backends.llamacpp.answers import (
    ChatPlan,
    Run,
    chat_choices,
    chat_message,
    chat_stream,
    completion,
    completion_chunks,
    completion_id,
)
from lemonkit.backends.llamacpp.batch import parallel_context
from lemonkit.backends.llamacpp.cpu_turns import CpuTurns, Turn, any_cores, on_cores
from lemonkit.backends.llamacpp.devices import Device, gpu_devices, load_on
from lemonkit.backends.llamacpp.draft_model import DraftModel
from lemonkit.backends.llamacpp.drafts import SpecSettings
from lemonkit.backends.llamacpp.generation import Generator, Sampling, check_arg, top_logprobs
from lemonkit.backends.llamacpp.jobs import Job
from lemonkit.backends.llamacpp.kernels import attention_build, rebuild_command, reference_kernels
from lemonkit.backends.llamacpp.mtp import MtpHead, mtp_layers
from lemonkit.backends.llamacpp.sampler import ReasoningBudget
from lemonkit.backends.llamacpp.vision import Vision, decode_data_url
from lemonkit.backends.protocol import Cancelled, LoadSpec, thread_count
from lemonkit.catalog.placement import MiB, estimate, fit_layers
from lemonkit.catalog.recipe_options import (
    DEFAULT_N_BATCH,
    DEFAULT_N_PARALLEL,
    MTP_DRAFT_MAX,
    draft_context,
    llamacpp_context_size,
)
from lemonkit.errors import (
    BackendUnavailable,
    InvalidArgument,
    KernelsUnavailable,
    ModelLoadError,
    ModelLoadRefused,
    ModelNotApplicable,
    NotEmbeddingModel,
)
from lemonkit.formats.gguf_header import read_gguf_context_length, read_gguf_layout
from lemonkit.formats.llamacpp_args import parse_llamacpp_args

__all__ = ["LlamaCppEngine"]

#: the most choices (``n``) or candidates (``best_of``) one request may ask for
MAX_CHOICES = 16

log = logging.getLogger(__name__)

#: MiB of host memory for prompts evicted from the slots (``--cache-ram``; llama-server's default is 8192): off
#: unless asked, as the memory plan counts the bound against every model loaded with it
DEFAULT_CACHE_RAM = 0


def _cpu_turns() -> CpuTurns | None:
    """The CPU turns this engine's decodes take, or None (with a warning) when their directory is unusable."""
    try:
        return CpuTurns()
    except OSError as exc:
        log.warning("llama.cpp decodes take no CPU turns (other sidecars may slow them down): %s", exc)
        return None


class LlamaCppEngine:
    """One GGUF loaded with llama-cpp-python, serving the OpenAI routes its ``type`` allows.

    Args:
        spec: ``model_path``; ``type`` ("llm", "embedding" or "reranking"); optional
            ``mmproj_path`` (vision), ``chat_format`` (a llama-cpp-python format name used when
            the GGUF has no chat template, e.g. "gemma") and ``options``: ``ctx_size`` (-1 or
            absent: the trained context capped at :data:`lemonkit.catalog.recipe_options.DEFAULT_CTX_SIZE`; 0: the
            trained context), ``n_threads`` (default: physical cores), ``llamacpp_args``
            (llama-server flags, see :func:`lemonkit.formats.llamacpp_args.parse_llamacpp_args`).

    Raises:
        InvalidArgument: Bad options.
        ModelLoadError: The model (or mmproj) does not load.
    """

    def __init__(self, spec: LoadSpec) -> None:
        # libgomp's default wait policy (spin briefly, then sleep) is kept: OMP_WAIT_POLICY=PASSIVE halved a single
        # stream on a quiet machine (86 -> 48 tok/s on Gemma 3 270M, benchmarks/concurrency.py); ACTIVE spins forever
        # and starves every other process of its cores. An operator's own OMP_WAIT_POLICY still applies.
        try:
            import llama_cpp
        except (ImportError, OSError, RuntimeError) as exc:  # its libraries do not load: the build, not the model
            raise BackendUnavailable(f"llama_cpp does not import: {exc}") from exc

        self.spec = spec
        kind = spec.get("type") or "llm"
        self.kind = {"embeddings": "embedding", "rerank": "reranking", "reranker": "reranking"}.get(kind, kind)
        if self.kind not in ("llm", "embedding", "reranking"):
            raise ModelLoadError(f"llamacpp cannot serve model type {self.kind!r}")
        path = spec.get("model_path")
        if not path or not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        options = dict(spec.get("options") or {})
        args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))

        self.n_ctx_train = read_gguf_context_length(path)
        ctx = options.get("ctx_size")
        if ctx is not None and (not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < -1):
            raise InvalidArgument(f"ctx_size must be a positive integer, -1 or 0, got {ctx!r}")
        # The server predicts this size (the options routes' resolved_ctx_size) with the same function.
        ctx = llamacpp_context_size(ctx, self.n_ctx_train, auto_limit=spec.get("auto_ctx_limit"))
        # The typed option beats a -t in llamacpp_args; physical cores beat SMT siblings for decode.
        arg_threads = args.pop("n_threads", None)
        threads = thread_count(options, arg_threads)

        self._sampling = Sampling.from_args(args)
        n_parallel = args.pop("n_parallel", DEFAULT_N_PARALLEL)
        cache_ram = args.pop("cache_ram", DEFAULT_CACHE_RAM)
        prefill_budget = args.pop("prefill_budget", None)
        #: an MTP head in a file of its own (a Gemma 4 assistant: the row's "draft" checkpoint, or -md with draft-mtp)
        self._head_path: str | None = spec.get("mtp_path")
        speculation = self._speculation_settings(args, spec.get("draft_path"), spec.get("labels") or ())
        # sequences beside the slots: one for padding (see kernels), one for rejected drafts' cells (see batch)
        limit = llama_cpp.llama_max_parallel_sequences() - 1 - speculation.on
        if n_parallel < 1 or n_parallel > limit:
            raise InvalidArgument(f"--parallel must be from 1 to {limit}, got {n_parallel}")
        self._n_parallel = n_parallel if self.kind == "llm" else 1
        n_ubatch = args.get("n_ubatch", DEFAULT_N_BATCH) if self.kind == "llm" else ctx
        chosen = self._placement(spec, args, path, ctx=ctx, n_ubatch=n_ubatch)
        invariant, repack = self._kernel_choice(args)
        template_override: str | None = args.pop("chat_template", None)

        kwargs: dict[str, Any] = {
            "n_ctx": ctx,
            "n_threads": threads,
            "n_threads_batch": args.pop("n_threads_batch", threads),
            "n_batch": DEFAULT_N_BATCH,
            "n_ubatch": DEFAULT_N_BATCH,
            "flash_attn": True,  # llama-server's "auto" on CPU; +10% tok/s measured on gemma-270m
            # Weights read into memory the sidecar's malloc backs with huge pages (see backends.sidecar_env), not
            # mapped from the file in 4 KiB pages: +10-15% tok/s on one stream measured on gemma-270m. --mmap maps.
            "use_mmap": False,
            "verbose": False,
        }
        if self.kind != "llm":
            # Non-causal encoders must see a whole input in one ubatch.
            kwargs.update(embedding=True, n_batch=ctx, n_ubatch=ctx)
            if self.kind == "reranking":
                kwargs["pooling_type"] = llama_cpp.LLAMA_POOLING_TYPE_RANK
        kwargs.update(args)
        kwargs["n_gpu_layers"] = self._offload["layers"]
        if self.kind == "llm" and kwargs["n_batch"] <= self._n_parallel:
            raise InvalidArgument(
                f"--batch-size ({kwargs['n_batch']}) must be more than --parallel ({self._n_parallel}): "
                "every step holds a token of each slot"
            )
        self._kwargs = kwargs
        try:
            with load_on(chosen):
                if self.kind == "llm":
                    with (
                        self._kernels(invariant) as switched,
                        parallel_context(
                            self._n_parallel + switched * (1 + speculation.on),
                            repack=repack,
                            mtp=speculation.wants_mtp,
                            # a recurrent model's drafts roll back into llama.cpp's per-token states (see _usable)
                            n_rs_seq=speculation.draft_max if speculation.on else 0,
                        ),
                    ):
                        self._llm: Any = llama_cpp.Llama(model_path=path, **kwargs)
                else:
                    self._llm = llama_cpp.Llama(model_path=path, **kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load {os.path.basename(path)}: {exc}") from exc
        self.batch_invariant = self.kind == "llm" and self._invariant
        if self.n_ctx_train is None:
            self.n_ctx_train = self._llm._model.n_ctx_train()
        self._fingerprint = f"llama-cpp-python-{llama_cpp.__version__}"
        self._sampling.n_vocab = self._llm.n_vocab()
        self._closed = False

        # Chat prompt: an explicit template, else the GGUF's, else a llama-cpp-python format.
        self._template: ChatTemplate | None = None
        self._formatter: Any = None
        self._format_name: str | None = None
        self._chat_format = FORMATS["hermes"]
        if self.kind == "llm":
            self._setup_chat_format(template_override, spec.get("chat_format"))
        mmproj = spec.get("mmproj_path")
        self._vision = Vision(self._llm, mmproj) if mmproj and self.kind == "llm" else None
        self._turns = _cpu_turns()
        self._turn: Turn = self._turns.turn if self._turns is not None else any_cores
        draft_model = mtp = None
        try:
            speculation = self._speculation = self._usable(speculation)
            if speculation.wants_mtp:
                with load_on(chosen):
                    mtp = MtpHead(
                        self._llm,
                        n_seq=self._n_parallel,
                        n_ctx=draft_context(ctx, self._n_parallel, speculation.draft_max),
                        n_batch=kwargs["n_batch"],
                        threads=(threads, kwargs["n_threads_batch"]),
                        is_eog=functools.partial(_vocab_eog, self._llm._model.vocab),
                        turn=self._turn,
                        head_path=self._head_path,
                        # a head file reads the target's last layers' cache: beside it (llama.cpp offloads the last
                        # layers first)
                        n_gpu_layers=999 if self._offload["layers"] else 0,
                    )
            if speculation.wants_model:
                with load_on(chosen):
                    draft_model = DraftModel(
                        str(spec.get("draft_path")),
                        target=self._llm,
                        n_seq=self._n_parallel,
                        n_ctx=draft_context(ctx, self._n_parallel, speculation.draft_max),
                        n_batch=kwargs["n_batch"],
                        threads=(threads, kwargs["n_threads_batch"]),
                        is_eog=functools.partial(_vocab_eog, self._llm._model.vocab),
                        repack=not amx_cpu(),
                        turn=self._turn,
                        # on the CPU even beside a target on a GPU: decoding the draft model on lavapipe (Vulkan)
                        # crashed the process in its first drafts, with the target there decoding fine
                        n_gpu_layers=0,
                    )
        except BaseException:
            if mtp is not None:
                mtp.close()
            self._llm.close()
            if self._turns is not None:
                self._turns.close()
            raise
        self._gen = Generator(
            self._llm,
            self._vision,
            n_parallel=self._n_parallel,
            n_batch=kwargs["n_batch"],
            invariant=self.batch_invariant,
            turn=self._turn,
            cache_ram=cache_ram * 2**20 if cache_ram > 0 else cache_ram,
            prefill_budget=prefill_budget,
            spec=speculation,
            draft_model=draft_model,
            mtp=mtp,
        )
        if self.kind == "llm":
            self._gen.preserve(self._chat_format.markers)
        self._gen.context_hint = _context_hint(str(spec.get("model_name") or "the model"), ctx, self.n_ctx_train)

    def _speculation_settings(
        self, args: dict[str, Any], draft_path: str | None, labels: Iterable[str]
    ) -> SpecSettings:
        """``--spec-type`` and its sizes (popped from ``args``); a draft model (``-md``, the registry's draft
        checkpoint or a companion GGUF, resolved by the server into ``draft_path``) makes ``draft-simple`` the
        default type, as ``-md`` does in llama-server, and the ``mtp`` label ``draft-mtp`` with its sizes (the
        spec's defaults: 3 tokens, p-min 0.75), where the model turns out to have usable MTP layers (see
        :meth:`_usable`)."""
        args.pop("model_draft", None)  # the server resolved it into draft_path
        kinds = args.pop("spec_type", None)
        #: speculation is the mtp label's default, not asked for: a model that cannot do it loads without
        self._spec_by_label = kinds is None and not draft_path and "mtp" in labels
        if kinds is None:
            kinds = ("draft-simple",) if draft_path else ("draft-mtp",) if self._spec_by_label else ()
        mtp = "draft-mtp" in kinds
        draft_max = args.pop("draft_max", MTP_DRAFT_MAX if mtp else SpecSettings.draft_max)
        settings = SpecSettings(
            kinds=kinds if self.kind == "llm" else (),
            draft_max=draft_max,
            draft_min=min(draft_max, args.pop("draft_min", SpecSettings.draft_min)),  # a floor cannot pass the cap
            p_min=args.pop("draft_p_min", SpecSettings.p_min),
            ngram=args.pop("ngram_n", SpecSettings.ngram),
            simple_max=args.pop("ngram_m", SpecSettings.simple_max),
            mod_match=args.pop("ngram_mod_match", SpecSettings.mod_match),
            mod_min=args.pop("ngram_mod_min", SpecSettings.mod_min),
            mod_max=args.pop("ngram_mod_max", SpecSettings.mod_max),
        )
        if settings.wants_model and not draft_path:
            raise InvalidArgument(
                "llamacpp_args: --spec-type draft-simple needs a draft model: name one with -md <registered model>, "
                'give the model a "draft" checkpoint, or put a *draft*.gguf beside its file'
            )
        self._speculation = settings
        return settings

    def _usable(self, settings: SpecSettings) -> SpecSettings:
        """``settings`` once the model is loaded: speculation off where the model cannot speculate and only the
        ``mtp`` label asked for it; on a model with recurrent layers every draft at most ``--spec-draft-n-max``
        tokens, the states llama.cpp keeps per token of a sequence's last decode (``n_rs_seq``) to roll a rejected
        draft back into.

        Raises:
            ModelLoadRefused: ``--spec-type`` asked for what the model cannot do: drafts on a model whose recurrent
                layers llama.cpp cannot roll back (Mamba, RWKV: it keeps no per-token states for them), or
                ``draft-mtp`` on a model without MTP layers.
        """
        import llama_cpp

        if not settings.on:
            return settings
        model = self._llm._model.model
        recurrent = llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        stuck = recurrent and llama_cpp.llama_n_rs_seq(self._llm._ctx.ctx) < settings.draft_max
        no_head = settings.wants_mtp and mtp_layers(self._llm) <= 0 and self._head_path is None
        if stuck or no_head:
            if self._spec_by_label:
                why = "its recurrent layers cannot be rolled back" if stuck else "its file has no MTP layers"
                log.info("the mtp label's draft-mtp is off for this model: %s", why)
                return dataclasses.replace(settings, kinds=())
            if stuck:
                raise ModelLoadRefused(
                    "llamacpp_args: --spec-type: this model has recurrent layers (a state per sequence, not a cache "
                    "per token) that llama.cpp cannot roll back past rejected drafts; load it without --spec-type"
                )
            return settings  # MtpHead refuses it, saying why
        if not recurrent:
            return settings
        n = settings.draft_max
        return dataclasses.replace(
            settings,
            simple_max=min(settings.simple_max, n),
            mod_max=min(settings.mod_max, n),
            mod_min=min(settings.mod_min, n),
            draft_min=min(settings.draft_min, n),
        )

    def _placement(
        self, spec: LoadSpec, args: dict[str, Any], path: str, *, ctx: int, n_ubatch: int
    ) -> list[Device] | None:
        """Decide ``-ngl`` and the devices (llama-server's flags, popped from ``args``): sets ``self._offload`` and
        ``self._devices``; returns the device list a load is restricted to (``None``: llama.cpp's default, all).

        ``auto`` (the default) offloads as many layers as :func:`lemonkit.catalog.placement.fit_layers` fits in the
        chosen devices' free memory, capped by the manager's ``device_budget``; ``all`` every layer, a number that many.
        """
        asked = args.pop("n_gpu_layers", "auto")
        names = args.pop("devices", None)
        available = [d for d in gpu_devices() if d.kind in ("gpu", "igpu")]
        if names is None:
            chosen, restrict = available, None
        else:
            by_name = {d.name: d for d in available}
            unknown = [n for n in names if n not in by_name]
            if unknown:
                have = ", ".join(by_name) or "none: this build has no GPU device here"
                raise InvalidArgument(f"llamacpp_args: --device {','.join(unknown)} is not a device (devices: {have})")
            chosen = restrict = [by_name[n] for n in names]
        layout = read_gguf_layout(path)
        n_layer = layout.n_layer if layout is not None else None
        everything = (n_layer + 1) if n_layer is not None else 0x7FFFFFFF
        fit = {
            "n_ctx": ctx,
            "n_ubatch": n_ubatch,
            "type_k": args.get("type_k", 1),
            "type_v": args.get("type_v", 1),
            "kv_offload": args.get("offload_kqv", True),
            # a recurrent model's states: per slot (with the padding and retire sequences), per rollback token
            "n_seq": self._n_parallel + 2,
            "n_rs_seq": self._speculation.draft_max if self._speculation.on else 0,
            "mtp": self._speculation.wants_mtp,  # the head's own context, with its compute buffer
        }
        budget = None
        if not chosen:
            layers = 0
        elif asked == "all":
            layers = everything
        elif asked == "auto":
            free = sum(d.free for d in chosen) * 9 // 10  # a tenth kept for the driver and other programs
            budget = min(free, spec.get("device_budget") or free)
            # a head file goes on the GPU whole beside any offloaded layer (see MtpHead's n_gpu_layers)
            head = os.path.getsize(self._head_path) if self._head_path and self._speculation.wants_mtp else 0
            layers = fit_layers(layout, budget - head, **fit).layers if layout is not None else everything
        else:
            layers = min(int(asked), everything)
        guess = estimate(layout, layers, **fit) if layout is not None else None
        self._devices = [d for d in chosen] if layers else []
        self._offload: dict[str, Any] = {
            "layers": layers,
            "of": everything if n_layer is not None else None,
            "requested": asked,
            "estimate_mb": round(guess.total / MiB) if guess is not None else None,
            **({"budget_mb": round(budget / MiB)} if budget is not None else {}),
        }
        return restrict

    def _kernel_choice(self, args: dict[str, Any]) -> tuple[bool, bool]:
        """``(batch_invariant, repack)`` from ``--[no-]batch-invariant`` and ``--[no-]repack``: chat models default to
        batch-invariant kernels, which need unpacked weights."""
        asked = args.pop("batch_invariant", None)
        repack = args.pop("repack", None)
        self._invariant_asked = bool(asked)
        self._invariant = False
        self.invariant_attention = False
        offloaded = self._offload["layers"] > 0
        if asked and offloaded:
            raise InvalidArgument(
                "llamacpp_args: --batch-invariant holds on the CPU backend only; add -ngl 0 to run this model there"
            )
        # GPU kernels make no such promise, and the CPU's reference mode would only slow what stays on the CPU
        invariant = (self.kind == "llm" and not offloaded) if asked is None else asked
        if invariant and repack:
            raise InvalidArgument(
                "llamacpp_args: --repack rounds differently for different batch shapes; "
                "add --no-batch-invariant to use it"
            )
        # ggml's repacked CPU kernels segfault on AMX CPUs in this build (SmolLM2's Q4_1, any prompt of a few tokens,
        # measured on a Sapphire Rapids VM): off there unless asked for; the plain kernels are the ones chat uses
        return invariant, (not invariant and not amx_cpu()) if repack is None else repack

    @contextlib.contextmanager
    def _kernels(self, invariant: bool) -> Iterator[int]:
        """Load inside on batch-invariant kernels when ``invariant``; yields the sequences the context needs beside
        the slots (the batcher's spare, for padding) and sets ``self._invariant`` once the load went through them."""
        switched: list[int] | None = None
        with contextlib.ExitStack() as stack:
            if invariant:
                try:
                    switched = stack.enter_context(reference_kernels())
                except KernelsUnavailable as exc:
                    if self._invariant_asked:
                        raise ModelLoadError(f"--batch-invariant: {exc}") from exc
                    log.warning("no batch-invariant kernels, answers may depend on the batch: %s", exc)
            yield int(switched is not None)
        self._invariant = bool(switched)
        build = attention_build() if self._invariant else "missing"
        self.invariant_attention = build in ("current", "older")
        if self._invariant and build == "unsupported":
            log.warning("lemonkit's batch-invariant attention has no code for this CPU: ggml's per-row attention runs")
        elif self._invariant and build != "current":
            log.warning(
                "this llama-cpp-python build %s: answers stay batch-invariant, %s. Rebuild it: %s",
                "carries an older lemonkit's batch-invariant attention"
                if build == "older"
                else "lacks lemonkit's batch-invariant attention (built without llama-cpp-lean.cmake, or a wheel pip "
                "cached from before)",
                "at that kernel's speed" if build == "older" else "long prompts at half speed",
                rebuild_command(),
            )

    def _setup_chat_format(self, override: str | None, chat_format: str | None) -> None:
        from llama_cpp import llama_chat_format

        llm = self._llm
        bos_id, eos_id = llm.token_bos(), llm.token_eos()
        bos = llm._model.token_get_text(bos_id) if bos_id >= 0 else ""
        eos = llm._model.token_get_text(eos_id) if eos_id >= 0 else ""
        source = None
        if override is not None:
            if formatter_by_name(llama_chat_format, override) is not None:
                chat_format = override  # llama-server also takes built-in template names
            else:
                source = override
        if source is None and override is None:
            source = llm.metadata.get("tokenizer.chat_template") or None
        self._template_source = source or ""
        # the family's tool-call and reasoning markup, read off the template (Hermes for built-in formats)
        self._chat_format = detect_format(source)
        if source is not None:
            try:
                self._template = ChatTemplate(source, bos_token=bos, eos_token=eos)
            except ValueError as exc:
                raise ModelLoadError(str(exc)) from exc
            return
        # llama-server falls back to ChatML when a model has no template
        name = chat_format or "chatml"
        self._formatter = formatter_by_name(llama_chat_format, name)
        if self._formatter is None:
            raise ModelLoadError(f"unknown chat_format {name!r}")
        self._format_name = name

    # ------------------------------------------------------------------ protocol

    def info(self) -> dict[str, Any]:
        """Facts about the loaded model (resolved ``ctx_size``, threads, ...)."""
        return {
            "type": self.kind,
            "ctx_size": self._gen.n_ctx,
            "n_ctx_train": self.n_ctx_train,
            "n_threads": self._kwargs["n_threads"],
            "n_batch": self._kwargs["n_batch"],
            "flash_attn": bool(self._kwargs["flash_attn"]),
            "mmap": bool(self._kwargs["use_mmap"]),
            "batch_invariant": self.batch_invariant,
            "invariant_attention": self.batch_invariant and self.invariant_attention,
            "device": "gpu" if self._offload["layers"] else "cpu",
            "backend": str((self.spec.get("options") or {}).get("llamacpp_backend") or "cpu"),
            "devices": [d.info() for d in self._devices],
            "offload": dict(self._offload),
            "vision": self._vision is not None,
            "chat_template": "jinja" if self._template is not None else self._format_name,
            "engine": self._fingerprint,
            "slots": self._n_parallel,  # requests served at once: the manager admits this many
            "speculative": list(self._speculation.kinds),  # --spec-type in use, the mtp label's default included
        }

    def stats(self) -> dict[str, Any]:
        """``/v1/stats`` fields of the last generation (empty before the first)."""
        return dict(self._gen.stats)

    def metrics(self) -> dict[str, Any]:
        """Every generation's figures since the load (:class:`lemonkit.formats.generation_metrics.GenerationTotals`)."""
        return self._gen.totals.to_dict()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._gen.close()
            self._llm.close()
            if self._turns is not None:
                self._turns.close()

    def chat(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/chat/completions``; validates eagerly, so bad input raises before any chunk."""
        if self.kind != "llm":
            raise ModelNotApplicable(f"this is a {self.kind} model: it does not serve chat completions")
        t_start = time.perf_counter()
        n = body.get("n", 1)
        check_arg(
            "n", n, isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES, f"1 to {MAX_CHOICES}"
        )
        job, plan = self._chat_job(body)
        jobs = _choices(job, n)
        base = self._base(body, "chatcmpl-", "chat.completion.chunk" if body.get("stream") else "chat.completion")
        runs: list[Run] = []
        gen = self._gen
        deltas = chat_choices(
            jobs, plan, t_start, gen.generate, gen.token_bytes, runs, cancelled, window=gen.n_parallel
        )
        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
            return chat_stream(base, deltas, runs, jobs, include_usage, cancelled)
        return chat_message(base, deltas, runs, jobs)

    def complete(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/completions``: one choice per prompt, in order."""
        if self.kind != "llm":
            raise ModelNotApplicable(f"this is a {self.kind} model: it does not serve completions")
        t_start = time.perf_counter()
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidArgument("'prompt' must be a string or a non-empty array of strings")
        logprobs = body.get("logprobs")
        if logprobs is None or logprobs is False:
            n_probs = None
        elif logprobs is True:
            n_probs = 1
        else:
            n_probs = top_logprobs("logprobs", logprobs, "a boolean or an integer")
        grammar = self._grammar_of(body)
        n, best_of = body.get("n", 1), body.get("best_of")
        ok = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES
        check_arg("n", n, ok, f"an integer from 1 to {MAX_CHOICES}")
        if best_of is None:
            best_of = n
        ok = isinstance(best_of, int) and not isinstance(best_of, bool) and n <= best_of <= MAX_CHOICES
        check_arg("best_of", best_of, ok, f"an integer from n ({n}) to {MAX_CHOICES}")
        ranked = best_of > n  # candidates scored by their mean token logprob, the best n returned
        if ranked and body.get("stream"):
            raise InvalidArgument("'best_of' cannot be streamed: the best candidates are known only at the end")
        suffix = body.get("suffix")
        check_arg("suffix", suffix, suffix is None or isinstance(suffix, str), "a string")
        gen = self._gen
        jobs = []
        for p in prompts:
            tokens = gen.fim_tokens(p, suffix) if suffix is not None else gen.tokenize(p)
            first = self._sampling.job(
                body, tokens, n_probs=0 if ranked and n_probs is None else n_probs, prompt=p, grammar=grammar
            )
            # the choices of one prompt: seeds one apart, so a seeded request stays reproducible
            jobs += [first] + [
                dataclasses.replace(first, seed=(first.seed + i) & 0xFFFFFFFF) for i in range(1, best_of)
            ]

        base = self._base(body, "cmpl-", "text_completion")
        runs: list[Run] = []
        echo = bool(body.get("echo"))
        chunks = completion_chunks(
            base, jobs, echo, t_start, gen.generate, gen.token_bytes, runs, cancelled, window=gen.n_parallel
        )
        if body.get("stream"):
            return chunks
        answer = completion(base, jobs, chunks, runs)
        if ranked:
            answer["choices"] = _best_choices(answer["choices"], best_of, n, keep_logprobs=n_probs is not None)
        return answer

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/tokenize`` as llama-server answers it: ``content``'s token ids (special tokens parsed), the BOS first
        with ``add_special``, each with its ``piece`` with ``with_pieces`` (a string, or its bytes when they are
        not UTF-8 on their own)."""
        content = body.get("content")
        if not isinstance(content, str):
            raise InvalidArgument("content: required, a string")
        add_special, with_pieces = body.get("add_special", False), body.get("with_pieces", False)
        for name, value in (("add_special", add_special), ("with_pieces", with_pieces)):
            check_arg(name, value, isinstance(value, bool), "a boolean")
        tokens: list[int] = self._llm.tokenize(content.encode("utf-8"), add_bos=add_special, special=True)
        if not with_pieces:
            return {"tokens": tokens}
        pieces = []
        for token in tokens:
            raw = self._llm.detokenize([token], special=True)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": token, "piece": piece})
        return {"tokens": pieces}

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/detokenize``: the text of ``tokens`` (ids of this model's vocabulary)."""
        tokens = body.get("tokens")
        n_vocab = self._llm.n_vocab()
        ok = isinstance(tokens, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in tokens
        )
        check_arg("tokens", tokens, ok, f"a list of token ids from 0 to {n_vocab - 1}")
        return {"content": self._llm.detokenize(tokens, special=True).decode("utf-8", "replace")}

    def props(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/props`` as llama-server answers it: the context, slots, chat template and sampling defaults."""
        return {
            "default_generation_settings": {"n_ctx": self._gen.n_ctx, "params": dict(self._sampling.defaults)},
            "total_slots": self._n_parallel,
            "model_path": str(self.spec.get("model_path") or ""),
            "chat_template": self._template_source,
            "n_ctx": self._gen.n_ctx,
            "n_ctx_train": self.n_ctx_train,
            "modalities": {"vision": self._vision is not None, "audio": False},
            "build_info": self._fingerprint,
        }

    def slots(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/slots``: each slot's state (llama-server's fields where lemonkit's batcher has them)."""
        return {"slots": self._gen.slots()}

    def slot_action(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/slots/action``: ``{"id_slot", "action": "save" | "restore" | "erase", "path"}``, ``path`` a file
        the server chose under its cache (llama-server's ``POST /slots/{id}?action=``)."""
        if self.kind != "llm":
            raise ModelNotApplicable(f"{self.kind} models have no generation slots")
        slot, path = body.get("id_slot"), body.get("path")
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise InvalidArgument(f"'id_slot' must be a slot number, got {slot!r}")
        return self._gen.slot_action(slot, str(body.get("action")), path if isinstance(path, str) else None)

    def count_chat_tokens(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/chat/tokens``: the tokens of the prompt a chat request renders to (its messages, tools and system
        turn through the model's template), without generating, whether or not they fit: Anthropic's
        ``count_tokens``."""
        job, _ = self._chat_job(body, fit=False)
        return {"input_tokens": len(job.tokens)}

    def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/embeddings``: L2-normalised float vectors, one per input."""
        if self.kind != "embedding":
            raise NotEmbeddingModel("this model was not loaded for embeddings")
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if not isinstance(inputs, list) or not inputs or not all(isinstance(s, str) for s in inputs):
            raise InvalidArgument("'input' must be a string or a non-empty array of strings")
        limit = self._kwargs["n_ubatch"]
        for i, text in enumerate(inputs):
            n = len(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))
            if n > limit:
                raise InvalidArgument(f"input[{i}] has {n} tokens, more than the model's {limit}-token window")
        try:
            with self._cores():
                vectors, n_tokens = self._llm.embed(inputs, normalize=True, truncate=False, return_count=True)
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"embedding failed: {exc}") from exc
        data = []
        for i, vec in enumerate(vectors):
            if vec and isinstance(vec[0], list):  # pooling "none": one vector per token -> mean, renormalise
                vec = _l2([sum(col) / len(vec) for col in zip(*vec, strict=True)])
            data.append({"object": "embedding", "index": i, "embedding": [float(x) for x in vec]})
        return {
            "object": "list",
            "data": data,
            "model": body.get("model", ""),
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    @contextlib.contextmanager
    def _cores(self) -> Iterator[None]:
        """An embedding or rerank decode on the cores its turn gives (``-tb`` at most)."""
        import llama_cpp

        with on_cores(self._turn, (self._kwargs["n_threads"], self._kwargs["n_threads_batch"])) as given:
            llama_cpp.llama_set_n_threads(self._llm._ctx.ctx, *given)
            yield

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/rerank``: documents scored against ``query``, best first (llama-server's shape)."""
        if self.kind != "reranking":
            raise ModelNotApplicable("this model was not loaded for reranking")
        query = body.get("query")
        docs = body.get("documents")
        if not isinstance(query, str):
            raise InvalidArgument("'query' must be a string")
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise InvalidArgument("'documents' must be a non-empty array of strings")
        top_n = body.get("top_n")
        if top_n is not None:
            check_arg("top_n", top_n, isinstance(top_n, int) and top_n >= 1, "a positive integer")
        from lemonkit.backends.llama_rank import rank_scores

        try:
            with self._cores():
                scores, n_tokens = rank_scores(self._llm, query, docs)
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"rerank failed: {exc}") from exc
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if top_n is not None:
            order = order[:top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
            if body.get("return_documents"):
                item["document"] = {"text": docs[i]}
            results.append(item)
        return {
            "model": body.get("model", ""),
            "object": "list",
            "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    # ------------------------------------------------------------------ chat requests

    def _base(self, body: dict[str, Any], prefix: str, kind: str) -> dict[str, Any]:
        """The fields every answer and chunk of one request shares."""
        return {
            "id": completion_id(prefix),
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model", ""),
            "system_fingerprint": self._fingerprint,
        }

    def _chat_job(self, body: dict[str, Any], *, fit: bool = True) -> tuple[Job, ChatPlan]:
        tools = parse_tools(body.get("tools"))
        mode, forced = _tool_mode(body.get("tool_choice"), tools)
        prompt_tools = tools if mode != "plain" else None

        n_probs = top_logprobs("top_logprobs", body.get("top_logprobs") or 0) if body.get("logprobs") else None

        template_kwargs = _template_kwargs(body)
        thinking = body.get("enable_thinking")
        if thinking is None:
            thinking = body.get("thinking")
            if isinstance(thinking, dict):  # {"type": "enabled" | "disabled"}
                thinking = thinking.get("type") != "disabled"
        if thinking is None and "enable_thinking" in template_kwargs:
            thinking = template_kwargs.pop("enable_thinking")
        if thinking is None and template_kwargs.get("reasoning_effort") == "none":
            thinking = False
        budget = _reasoning_budget(body, self._sampling.reasoning_budget)
        if thinking is None and budget == 0:
            thinking = False  # no tokens for reasoning: ask templates that can for none
        enable_thinking = None if thinking is None else bool(thinking)
        parallel = body.get("parallel_tool_calls", True)
        check_arg("parallel_tool_calls", parallel, isinstance(parallel, bool), "a boolean")

        think = self._chat_format.think
        if mode == "forced":
            assert tools is not None
            grammar: str | None = tool_call_grammar(tools, forced)
        else:
            grammar = response_format_grammar(body.get("response_format"))
        shaped = grammar is not None  # the grammar shapes the whole answer: no reasoning, no markup
        if body.get("grammar") is not None and shaped:
            raise InvalidArgument("'grammar' cannot be combined with response_format or a forced tool_choice")
        if not shaped:
            grammar = self._grammar_of(body)  # tool-call markup the grammar shapes is still read
        elif grammar is not None:
            self._gen.check_grammar(grammar)
        if shaped and enable_thinking is None:
            enable_thinking = False  # constrained output starts at once: ask thinking templates for no think block

        images: list[str] | None = [] if self._vision is not None else None
        prompt, extra_stops = self._render(body.get("messages"), prompt_tools, enable_thinking, images, template_kwargs)
        opens = prompt_opens_thinking(prompt, think)
        if shaped and opens and think is not None:
            prompt += f"\n{think[1]}\n\n"  # a template that always opens its reasoning: close it, empty
        # Vision prompts are tokenized again by mtmd with their images (Vision.prefill); the text
        # alone already tells whether the prompt fits.
        tokens = self._gen.tokenize(prompt, fit=fit)
        job = self._sampling.job(body, tokens, n_probs=n_probs, prompt=prompt, extra_stops=extra_stops, grammar=grammar)
        job.images = [decode_data_url(url) for url in images or []]
        # a forced close would leave a grammar behind: budgets bound free reasoning only
        if budget is not None and think is not None and grammar is None:
            gen = self._gen
            job.budget = ReasoningBudget(
                limit=budget,
                inside=opens,
                open_ids=gen.special_ids(think[0]),
                close_ids=gen.special_ids(think[1]),
                forced_ids=gen.special_ids(f"\n{think[1]}\n\n"),
            )
        if shaped and mode != "forced":
            mode = "json"  # the response_format grammar shaped the whole answer: no tags, no tool-call markup
        plan = ChatPlan(
            mode=mode,
            tools=tools if mode in ("auto", "forced") else None,
            in_reasoning=opens and not shaped,
            fmt=self._chat_format,
            parallel=parallel,
        )
        return job, plan

    def _grammar_of(self, body: dict[str, Any]) -> str | None:
        """llama-server's ``grammar`` field (GBNF the answer follows), else the model's ``--grammar``; checked."""
        grammar = body.get("grammar")
        if grammar is None:
            grammar = self._sampling.grammar
        if grammar is not None:
            check_arg("grammar", grammar, isinstance(grammar, str) and bool(grammar.strip()), "a GBNF string")
            self._gen.check_grammar(grammar)
        return grammar

    def _render(
        self,
        raw_messages: Any,
        tools: ToolSpec | None,
        enable_thinking: bool | None,
        images: list[str] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[str]]:
        """The prompt text, and the stop strings its chat format adds (collects image URLs into ``images``)."""
        marker = self._vision.marker if self._vision is not None else None
        tmpl = self._template
        if tmpl is not None:
            messages = normalize_messages(
                raw_messages, tools_in_template=tmpl.supports_tools, image_marker=marker, images=images
            )
            if tools is not None and not tmpl.supports_tools:
                messages = with_system(messages, tool_system_prompt(tools))
            if not tmpl.supports_system:
                messages = merge_system_messages(messages)
            prompt = tmpl.render(
                messages,
                tools=tools.tools if tools and tmpl.supports_tools else None,
                enable_thinking=enable_thinking,
                **(template_kwargs or {}),
            )
            return prompt, []
        messages = normalize_messages(raw_messages, tools_in_template=False, image_marker=marker, images=images)
        if tools is not None:
            messages = with_system(messages, tool_system_prompt(tools))
        if self._format_name == "gemma":  # Gemma's format drops system turns: fold them into the user's
            messages = merge_system_messages(messages)
        try:
            response = self._formatter(messages=messages)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"chat format {self._format_name!r} failed on these messages: {exc}") from exc
        stop = response.stop
        return response.prompt, [stop] if isinstance(stop, str) else list(stop or [])


def _context_hint(model: str, ctx: int, n_ctx_train: int | None) -> str:
    """How to give ``model`` a larger context than ``ctx``, for the error of a request that does not fit."""
    how = (
        f'load it with a larger ctx_size (POST /v1/load {{"model_name": "{model}", "ctx_size": N}}) or save '
        f'one in its options (POST /v1/models/{model}/options {{"ctx_size": N}}; 0 takes the whole trained context)'
    )
    if n_ctx_train is not None and n_ctx_train > ctx:
        return f". {model} was trained for {n_ctx_train} tokens and is loaded with {ctx}: {how}"
    if n_ctx_train is not None:
        return f". {model} is loaded with all {ctx} tokens it was trained for: shorten the request"
    return f": {how}"


#: variables the engine sets itself: a request's chat_template_kwargs may not replace them
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _choices(job: Job, n: int) -> list[Job]:
    """``n`` choices of one prompt, decoded together: seeds one apart, so a seeded request stays reproducible."""
    return [job] + [dataclasses.replace(job, seed=(job.seed + i) & 0xFFFFFFFF) for i in range(1, n)]


def _best_choices(choices: list[dict[str, Any]], best_of: int, n: int, *, keep_logprobs: bool) -> list[dict[str, Any]]:
    """Of each prompt's ``best_of`` candidates, the ``n`` with the highest mean token logprob (OpenAI's ranking),
    re-indexed in prompt order."""
    out: list[dict[str, Any]] = []
    for start in range(0, len(choices), best_of):
        group = choices[start : start + best_of]

        def score(choice: dict[str, Any]) -> float:
            values = (choice.get("logprobs") or {}).get("token_logprobs") or []
            return sum(values) / len(values) if values else -math.inf

        for choice in sorted(group, key=score, reverse=True)[:n]:
            if not keep_logprobs:
                choice["logprobs"] = None
            out.append({**choice, "index": len(out)})
    return out


def _reasoning_budget(body: dict[str, Any], default: int = -1) -> int | None:
    """The tokens the reasoning may take: ``reasoning_budget`` (llama-server's, -1 for no limit) or
    ``thinking.budget_tokens`` (Anthropic's), else the model's ``--reasoning-budget``; None when unlimited."""
    budget = body.get("reasoning_budget")
    thinking = body.get("thinking")
    name = "reasoning_budget"
    if budget is None and isinstance(thinking, dict) and thinking.get("budget_tokens") is not None:
        budget, name = thinking["budget_tokens"], "thinking.budget_tokens"
    if budget is None:
        budget = default
    ok = isinstance(budget, int) and not isinstance(budget, bool) and budget >= -1
    check_arg(name, budget, ok, "an integer >= 0 (-1: no limit)")
    return None if budget == -1 else budget


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` (llama-server's: extra variables for the template, such as ``enable_thinking``),
    with ``reasoning_effort`` added as the variable gpt-oss's template reads."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise InvalidArgument("chat_template_kwargs: expected an object whose keys are template variable names")
    own = sorted(_TEMPLATE_OWN & kwargs.keys())
    if own:
        raise InvalidArgument(f"chat_template_kwargs: {', '.join(own)} is set by the request itself, not here")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        check_arg("reasoning_effort", effort, effort in _EFFORTS, "one of " + ", ".join(_EFFORTS))
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def _tool_mode(choice: Any, tools: ToolSpec | None) -> tuple[str, str | None]:
    """``tool_choice`` as a mode ("plain", "auto" or "forced") and the forced function's name, if one is named."""
    forced: str | None = None
    if choice is None or choice == "auto":
        mode = "auto" if tools else "plain"
    elif choice == "none":
        mode = "plain"
    elif choice == "required":
        mode = "forced"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise InvalidArgument("tool_choice must be auto, none, required or a function: {'function': {name}}")
        mode, forced = "forced", name
    else:
        raise InvalidArgument(f"unsupported tool_choice {choice!r}")
    if mode == "forced":
        if tools is None:
            raise InvalidArgument("tool_choice requires a tool but the request has no 'tools'")
        if forced is not None and forced not in tools.params:
            raise InvalidArgument(f"tool_choice names {forced!r}, which is not among the request's tools")
    return mode, forced


@functools.cache
def _vocab_eog(vocab: Any, token: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(vocab, token))


def amx_cpu() -> bool:
    """Whether this CPU has AMX (``amx_int8`` in ``/proc/cpuinfo``), where ggml's repacked kernels crash."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


def _l2(vec: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else vec
