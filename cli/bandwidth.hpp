// The machine's sustained memory read bandwidth: the roof of decode attention, which reads the
// whole K/V cache once per call and does little arithmetic on it (`attn bench` with L <= 16).
//
// STREAM-like, read only: each thread sums its own contiguous share of one large float array with
// vector adds into several independent accumulators, so the loop is bound by the loads and not by
// the add latency. The array is several times the last-level cache (read from sysfs), so every pass
// comes from DRAM, on the library's own tensor pages (huge pages where Linux gives them, as the
// K/V's); it is written first by the same threads with the same partition (first touch, and the
// pages are resident before timing). A pass is timed from a barrier to the end of the
// parallel region (the slowest thread included); the result is the median pass, in GB/s of 1e9
// bytes. The ISA is picked at run time as in peak.cpp (AVX-512F, AVX2, else portable vectors).
#pragma once

#include <cstdint>
#include <string>

namespace attn::bench {

// Size in bytes of the largest (last-level) CPU cache sysfs reports for cpu0
// (/sys/devices/system/cpu/cpu0/cache/index*/size), or 0 if it reports none.
int64_t last_level_cache_bytes();

// MemAvailable of /proc/meminfo in bytes, or 0 if unreadable.
int64_t available_memory_bytes();

struct BandwidthResult {
  double gbps = 0.0;       // median pass: bytes read / wall time, 1e9 bytes/s
  double best_gbps = 0.0;  // fastest pass
  int threads = 0;         // the team OpenMP actually gave
  int passes = 0;          // timed passes
  int64_t bytes = 0;       // bytes read per pass (the array's size)
  int64_t llc_bytes = 0;   // last_level_cache_bytes() when measured (0: unknown)
  std::string isa;         // "avx512f", "avx2" or "generic"
};

// The array size the probe uses: 8x the last-level cache (1 GiB if unknown), at least 256 MiB,
// at most a quarter of the available memory.
int64_t bandwidth_array_bytes();

// Reads an array of bandwidth_array_bytes() on `threads` OpenMP threads: one untimed pass, then
// `passes` timed ones.
BandwidthResult measure_read_bandwidth(int threads, int passes = 7);

// The same bytes read in a paged KV pool's pattern: the array seen as (pages, streams, block),
// block = block_bytes rounded up to 512, each stream (a sequence) read as its blocks in page
// order, the streams one after another, the thread t of T taking the t-th T-th of that sequence
// of blocks (as the decode driver gives threads key ranges of a sequence). So a thread reads
// blocks of `block` bytes at a stride of streams * block, not one run: the pattern of
// `paged_attention`, which reads a pool page's kv heads together (block = the page's bytes of
// every head), on a pool whose pages interleave `streams` sequences.
// Reading a block, a thread prefetches its next one line by line (the hardware prefetchers stop
// at each block's end). Measured on AMD Zen 4, 2 threads, 16-token float32 pages of E = 128 and 8
// heads (8 KiB blocks, 64 KiB apart, the pattern of a kernel that read one head at a time), with
// a 61-66 GB/s contiguous probe: 26 GB/s without that prefetch, below the decode kernel's 28-33;
// 33-38 GB/s with it; 64-token pages 48-55 GB/s.
BandwidthResult measure_paged_read_bandwidth(int threads, int64_t block_bytes, int64_t streams, int passes = 7);

}  // namespace attn::bench
