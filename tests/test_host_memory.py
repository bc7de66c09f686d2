"""The CPU rank's large zeroed buffers (its KV cache): zeros that cost memory only once written,
and refused up front when the host has not the memory for them; a host tier's, faulted in at
once before they are page-locked."""

import pytest
import torch

from neuron.runner.host_memory import available_bytes, fault_in, zeroed


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_zeroed_buffer_reads_zeros_and_takes_memory_only_where_written():
    before = _rss()
    t = zeroed((2, 64, 1024, 1024), torch.device("cpu"), torch.float32, "test buffer")  # 512 MiB
    assert t.shape == (2, 64, 1024, 1024) and t.is_contiguous()
    assert _rss() - before < 64 << 20
    assert not t[1, 63].any() and not t[0, ::16, ::64].any()
    t[1, 5] = 3.0
    assert t[1, 5].sum().item() == 3.0 * 1024 * 1024 and not t[1, 4].any()
    assert _rss() - before < 128 << 20  # the 4 MiB written, not the 512


def test_a_buffer_larger_than_the_memory_available_is_refused_by_name():
    too_big = available_bytes() // 4 + (1 << 30)  # float32 elements: more bytes than are available
    with pytest.raises(torch.OutOfMemoryError, match="the KV cache needs .* GiB available: lower max_slots"):
        zeroed((too_big,), torch.device("cpu"), torch.float32, "KV cache")


def test_faulting_a_buffer_in_takes_all_its_pages_keeps_its_zeros_and_the_threads():
    t = zeroed((256, 1024, 1024), torch.device("cpu"), torch.uint8, "test buffer")  # 256 MiB
    threads = torch.get_num_threads()
    before = _rss()
    fault_in(t)
    assert _rss() - before > 240 << 20
    assert not t[::4096].any() and not t[-1].any()
    assert torch.get_num_threads() == threads
