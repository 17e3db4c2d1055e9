"""Idle unloading: the executables of a bucket no step used for `keep_alive` seconds are dropped while the engine is
idle (their host memory, ~1 MB per GPU code image, goes back to the OS), and loaded again from the executable cache
in the background once steps want the bucket (`RELOAD_AFTER_STEPS`); steps run padded into a loaded bucket meanwhile.

Never dropped: the buckets a staged warm-up made ready first and the smallest one (`_pinned`), and the
`KEEP_RECENT_BUCKETS` others that steps used last (prefill and decode-only buckets alike): the first request after
an idle spell is most likely shaped like the last ones, and a prefill padded into the next loaded bucket ran 2.9x
the warm TTFT on CPU (SmolLM2, 128 -> 256 tokens) until its own bucket was loaded again.

`IdleUnloading` is a part of `StepExecutables` (executables.py), whose registry (ready sets, `_compiled`, the
warm sampler keys, `_bucket_executables`, `_make_ready`) it works on.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

Bucket = tuple[int, int]  # (T, forward kind: 0 any step, 1 decode-only, Q verify)

# An unloaded bucket is loaded again once this many steps wanted it: sustained demand, not one request's few prefill
# chunks (a lone 1k-token prompt after an idle minute ran 0.15-0.2 s slower while the 512-2048 buckets its first
# chunk asked for loaded beside it; it needs none of them).
RELOAD_AFTER_STEPS = 16
# Buckets beyond the pinned ones kept through an idle spell: those steps used last. Each costs its executables' host
# memory while idle (a Qwen3-4B forward ~20 MB on an H100, whose idle engine holds ~800 MB against a 1 GB target).
KEEP_RECENT_BUCKETS = 2


def trim_host_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc only; a no-op elsewhere). Warm-up frees a lot
    (executable payloads read from disk, lowering and compile temporaries), spread over the arenas of
    its threads; glibc keeps such memory mapped, and it counted as the idle engine's RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def idle_buckets(last_used: dict[Bucket, float], stepped: dict[Bucket, float], now: float, keep_alive: float,
                 pinned: Collection[Bucket], busy: Collection[Bucket], keep_recent: int) -> list[Bucket]:
    """The buckets an idle unload drops: those whose last use (`last_used`: a step, or being made ready) is
    `keep_alive` seconds or more before `now`, but the `pinned` ones, the `busy` ones (unloaded or loading) and the
    `keep_recent` non-pinned ones steps used last (`stepped`: the time of each bucket's last step)."""
    if keep_alive <= 0 or keep_recent < 0:
        raise ValueError(f"{keep_alive=} must be > 0 and {keep_recent=} >= 0")
    recent = sorted((b for b in stepped if b not in pinned), key=stepped.__getitem__, reverse=True)[:keep_recent]
    return [b for b, t in last_used.items()
            if now - t >= keep_alive and b not in pinned and b not in busy and b not in recent]


class IdleUnloading:
    """Idle unloading's state and steps (see the module doc); `_init_idle` is called by `_init_registry`."""

    def _init_idle(self, keep_alive: float) -> None:
        self.keep_alive = float(keep_alive)
        self.keep_recent = KEEP_RECENT_BUCKETS
        self._pinned: frozenset[Bucket] = frozenset()  # never unloaded (set by a staged warm-up)
        self._last_used: dict[Bucket, float] = {}  # a step ran in it, or it was made ready
        self._stepped: dict[Bucket, float] = {}  # a step ran in it
        self._unloaded: set[Bucket] = set()
        self._loading: set[Bucket] = set()
        self._demand: dict[Bucket, int] = {}  # unloaded bucket -> steps that wanted it since
        self._loader: ThreadPoolExecutor | None = None
        self.unloads = self.reloads = 0  # buckets dropped as idle / loaded again

    def unload_idle(self, now: float | None = None) -> int:
        """Drop the forward executables of the buckets `idle_buckets` names; returns how many buckets. Call it from
        the thread that launches steps, between steps (the engine loop does, while idle): a step picks its bucket
        from the ready ones."""
        warming = self._background is not None and self._background.is_alive()
        if not self.keep_alive or not self._pinned or warming:  # (only after a staged warm-up)
            return 0
        now = time.monotonic() if now is None else now
        with self._ready_lock:
            idle = idle_buckets(self._last_used, self._stepped, now, self.keep_alive, self._pinned,
                                self._unloaded | self._loading, self.keep_recent)
            if not idle:
                return 0
            drop_tokens = {T for T, decode in idle if not decode}
            self.ready_tokens = tuple(T for T in self.ready_tokens if T not in drop_tokens)
            self.ready_decode = self.ready_decode - {T for T, decode in idle if decode == 1}
            self.ready_verify = self.ready_verify - {T for T, decode in idle if decode > 1}
            self._unloaded.update(idle)
            for b in idle:
                self._demand.pop(b, None)
            # ... and the warm sampler variants of every sequence bucket no loaded bucket has any more
            kept = {self.seqs_bucket(T) for T in (*self.ready_tokens, *self.ready_decode, *self.ready_verify)}
            kept |= {self.seqs_bucket(T) for T, _ in self._loading}
            samplers = {k for T, _ in idle for k in self._warm_sampler_keys(self.seqs_bucket(T))}
            samplers -= {k for B in kept for k in self._warm_sampler_keys(B)}
            for key in [k for k in list(self._compiled)  # (a snapshot: a reload may be adding keys)
                        if (bucket_of(k) in idle) or k in samplers]:
                del self._compiled[key]
        self.unloads += len(idle)
        trim_host_heap()
        log.info("unloaded the executables of %d bucket(s) idle for %.0f s: %s", len(idle), self.keep_alive,
                 ", ".join(f"{T}{kind_label(d)}" for T, d in sorted(idle)))
        return len(idle)

    def _note_use(self, T: int, decode: int, num_tokens: int, kind: int) -> None:
        """Idle unloading's bookkeeping for a step of bucket T: it was used now, and the unloaded buckets a step of
        `num_tokens` wanted (its own, and every larger one when it filled the scheduler's budget: the budget is the
        largest ready bucket, so the scheduler wanted more) count one more step towards their reload. `kind`: the
        forward kind the step could take (1 decode-only, Q a verify step, else 0)."""
        if not self.keep_alive:
            return
        if self._unloaded:
            wanted = min(U for U in self.token_buckets if U >= num_tokens)
            self._want(wanted, 0)
            if kind and kind in self.kinds(wanted):
                self._want(wanted, kind)
            if num_tokens >= self.ready_limits()[0]:
                for U in self.token_buckets:
                    if U > wanted:
                        self._want(U, 0)
        self._last_used[(T, decode)] = self._stepped[(T, decode)] = time.monotonic()

    def _want(self, T: int, decode: int) -> None:
        """A step wanted bucket T (decode-only or not) and it is unloaded: the RELOAD_AFTER_STEPS-th such step loads
        it again in the background (steps run padded into a ready bucket meanwhile)."""
        b = (T, decode)
        with self._ready_lock:
            if b not in self._unloaded or b in self._loading:
                return
            self._demand[b] = self._demand.get(b, 0) + 1
            if self._demand[b] < RELOAD_AFTER_STEPS:
                return
            del self._demand[b]
            self._loading.add(b)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jinfer-reload")  # one arena

        def load():
            try:
                self._bucket_executables(T, decode, background=True)  # (samplers unloaded with the last B bucket)
                self._make_ready(T, decode)
                self.reloads += 1
                log.info("loaded the executables of bucket %d%s again", T, kind_label(decode))
            except Exception:  # the step path goes on padded; a later step asks again
                log.exception("loading bucket %s again failed", b)
            finally:
                with self._ready_lock:
                    self._loading.discard(b)

        self._loader.submit(load)

    # (attributes of StepExecutables this part reads; declared for readers and type checkers)
    _background: threading.Thread | None
    _ready_lock: threading.Lock
    _compiled: dict


def bucket_of(key: tuple) -> Bucket | None:
    """(T, kind) of a forward executable's key (None for other executables and prompt-logits forwards)."""
    name = key[0]
    if name == "forward":
        return key[1], 0
    if name == "forward_decode":
        return key[1], 1
    if name.startswith("forward_q"):
        return key[1], int(name.removeprefix("forward_q"))
    return None


def kind_label(kind: int) -> str:
    return "" if kind == 0 else " decode" if kind == 1 else f" verify (q{kind})"
