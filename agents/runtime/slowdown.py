"""Make one GPU genuinely slower, in a way calibration sees.

:class:`SmHog` takes streaming multiprocessors away from everything else running on the
GPU: a kernel whose blocks stay resident on the chosen SMs (two 1024-thread blocks per SM
fill all 2048 thread slots of a Hopper SM, so no other kernel's block can be placed there)
and sleep until told to stop. Other kernels of the process then run on the remaining SMs -
as on a GPU with fewer SMs. Blocks that land on other SMs leave at once. Memory bandwidth
falls too, since fewer SMs issue loads. The kernel is built at run time with CuPy (NVRTC)
and launched on a non-blocking stream of its own; it stops by a flag copied to the device
from another stream, or by itself after ``max_s`` seconds (a guard: should anything wait
for the whole device meanwhile, it waits at most that long, and the report says so).

While it runs, nothing may wait for the whole device (``torch.cuda.synchronize``,
``cudaFree``): time with events and synchronize streams or events only. Load every kernel
before starting it (``CUDA_MODULE_LOADING=EAGER``), since loading one may wait for the device.

:class:`GemmLoad` is the fallback when CuPy is missing: a thread that keeps large BF16
GEMMs queued on a low-priority stream of the same device (a co-running compute load).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

_SRC = r"""
extern "C" __global__ void __launch_bounds__(1024, 2)
mixfleet_sm_hog(const volatile int* stop, unsigned int first_sm, unsigned int num_sms,
                unsigned long long max_ns, int* resident, int* timed_out) {
    unsigned int smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    if (smid < first_sm || smid >= first_sm + num_sms) return;
    if (threadIdx.x == 0) {
        atomicAdd(&resident[smid], 1);
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        while (*stop == 0) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t - t0 > max_ns) { atomicAdd(timed_out, 1); break; }
            __nanosleep(20000);
        }
    }
    __syncthreads();
}
"""


@dataclass
class SmHog:
    """Occupy ``num_sms`` SMs (from SM 0) of GPU ``device`` until :meth:`stop`.

    Attributes:
        device: CUDA device index.
        num_sms: SMs to take away.
        max_s: the kernel ends by itself after this many seconds.
    """

    device: int
    num_sms: int
    max_s: float = 600.0
    _state: dict[str, Any] = field(default_factory=dict)

    def start(self) -> dict[str, Any]:
        """Launch the kernel and check it holds every chosen SM with two blocks.

        Returns:
            ``{"sms_held", "sms_wanted", "attempts"}``.

        Raises:
            RuntimeError: CuPy is missing, or the SMs could not be held after 3 tries.
        """
        try:
            cp = importlib.import_module("cupy")
            import numpy as np
        except ImportError as exc:
            raise RuntimeError("SmHog needs CuPy (cupy-cuda12x or cupy-cuda13x)") from exc
        with cp.cuda.Device(self.device):
            props = cp.cuda.runtime.getDeviceProperties(self.device)
            total = int(props["multiProcessorCount"])
            kernel = cp.RawKernel(_SRC, "mixfleet_sm_hog", options=("-std=c++14",))
            kernel.compile()
            stream = cp.cuda.Stream(non_blocking=True)
            ctrl = cp.cuda.Stream(non_blocking=True)
            for attempt in range(1, 4):
                stop = cp.zeros(1, dtype=cp.int32)
                resident = cp.zeros(total, dtype=cp.int32)
                timed_out = cp.zeros(1, dtype=cp.int32)
                cp.cuda.Device(self.device).synchronize()
                with stream:
                    kernel(
                        (4 * total,),
                        (1024,),
                        (
                            stop,
                            np.uint32(0),
                            np.uint32(self.num_sms),
                            np.uint64(int(self.max_s * 1e9)),
                            resident,
                            timed_out,
                        ),
                    )
                held = 0
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline:
                    counts = cp.asnumpy(resident, stream=ctrl)
                    held = int((counts >= 2).sum())
                    if held >= self.num_sms:
                        break
                    time.sleep(0.01)
                self._state = {
                    "cp": cp,
                    "np": np,
                    "stream": stream,
                    "ctrl": ctrl,
                    "stop": stop,
                    "resident": resident,
                    "timed_out": timed_out,
                    "t0": time.monotonic(),
                }
                if held >= self.num_sms:
                    return {"sms_held": held, "sms_wanted": self.num_sms, "attempts": attempt}
                self.stop()
        raise RuntimeError(f"could not hold {self.num_sms} SMs (held {held}) after 3 tries")

    def running(self) -> bool:
        """The kernel still holds its SMs (it has neither been stopped nor timed out)."""
        st = self._state
        return bool(st) and not st["stream"].done

    def stop(self) -> dict[str, Any]:
        """Stop the kernel and report ``{"held_s", "timed_out_blocks"}`` (timed-out blocks
        mean something waited for the whole device while the hog ran)."""
        st = self._state
        if not st:
            return {}
        cp, np = st["cp"], st["np"]
        with cp.cuda.Device(self.device):
            st["stop"].set(np.ones(1, dtype=np.int32), stream=st["ctrl"])
            st["stream"].synchronize()
            timed_out = int(cp.asnumpy(st["timed_out"], stream=st["ctrl"])[0])
        self._state = {}
        return {"held_s": time.monotonic() - st["t0"], "timed_out_blocks": timed_out}


@dataclass
class GemmLoad:
    """A co-running compute load: ``size``-cubed BF16 GEMMs kept queued (at most
    ``inflight`` at a time) on a low-priority stream of ``device`` by a thread."""

    device: int
    size: int = 8192
    inflight: int = 2
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    launched: int = 0

    def start(self) -> dict[str, Any]:
        import torch

        dev = torch.device("cuda", self.device)
        a = torch.randn(self.size, self.size, device=dev, dtype=torch.bfloat16)
        b = torch.randn(self.size, self.size, device=dev, dtype=torch.bfloat16)
        stream = torch.cuda.Stream(device=dev, priority=0)

        def loop() -> None:
            pending: deque[Any] = deque()
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                while not self._stop.is_set():
                    a @ b
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    pending.append(ev)
                    self.launched += 1
                    if len(pending) >= self.inflight:
                        pending.popleft().synchronize()
                while pending:
                    pending.popleft().synchronize()

        self._stop.clear()
        self._thread = threading.Thread(target=loop, name="mixfleet-gemm-load", daemon=True)
        self._thread.start()
        return {"gemm": self.size, "inflight": self.inflight}

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {"gemms_launched": self.launched}
