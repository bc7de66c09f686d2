"""What a rank tells of its device with each heartbeat (``protocol.Telemetry``): memory used and
total, utilisation and temperature where the driver reports them (NVML on a GPU, the thermal
zone on a CPU), and on a CPU the kernel level and torch's threads. Sampled on the rank's I/O loop,
never with a CUDA call (one from another thread could break a graph capture on the device
thread): NVML, the allocator's counters and /proc."""

from __future__ import annotations

import os
import time
from pathlib import Path

import protocol as p
import torch

THERMAL = Path("/sys/class/thermal")


def _nvml(index: int):
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # no NVML library, no driver, no such device: nothing reports
        return None


def _cpu_temperature() -> float:
    for zone in sorted(THERMAL.glob("thermal_zone*")):
        try:
            kind = (zone / "type").read_text().strip()
            if kind in ("x86_pkg_temp", "k10temp", "cpu-thermal", "soc_thermal", "acpitz"):
                return int((zone / "temp").read_text()) / 1000
        except (OSError, ValueError):
            continue
    return -1.0


class TelemetrySampler:
    """Made on the device thread (it reads the device's properties once there)."""

    def __init__(self, device: torch.device, cpu_isa: str = "") -> None:
        self.device = device
        self.cpu_isa = cpu_isa
        self.nvml = None
        self.total = 0
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.total = torch.cuda.get_device_properties(index).total_memory
            self.nvml = _nvml(index)
        self._last = (time.monotonic(), sum(os.times()[:2]))

    def sample(self) -> p.Telemetry:
        if self.device.type == "cuda":
            return self._gpu()
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        used = total - os.sysconf("SC_AVPHYS_PAGES") * page
        now, cpu = time.monotonic(), sum(os.times()[:2])
        (then, before), self._last = self._last, (now, cpu)
        threads = torch.get_num_threads()
        busy = 100.0 * (cpu - before) / max(now - then, 1e-3) / max(threads, 1)
        return p.Telemetry(device="cpu", memory_used=int(used), memory_total=int(total),
                           utilization=round(min(busy, 100.0), 1), temperature_c=_cpu_temperature(),
                           cpu_isa=self.cpu_isa, threads=threads, torch=str(torch.__version__))

    def _gpu(self) -> p.Telemetry:
        name = str(self.device)
        if self.nvml is not None:
            nvml, handle = self.nvml
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                temp = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                return p.Telemetry(device=name, memory_used=int(memory.used), memory_total=int(memory.total),
                                   utilization=float(util), temperature_c=float(temp), torch=str(torch.__version__),
                                   cuda=torch.version.cuda or "")
            except Exception:  # the driver stopped answering: what the allocator knows
                self.nvml = None
        return p.Telemetry(device=name, memory_used=int(torch.cuda.memory_reserved(self.device)),
                           memory_total=int(self.total), torch=str(torch.__version__), cuda=torch.version.cuda or "")
