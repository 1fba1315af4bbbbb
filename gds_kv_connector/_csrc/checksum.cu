// Payload checksum of many KV blocks in one launch (gds_kv_connector/checksum.py, version 1).
//
// Every word contributes fmix(w[i] ^ ((i + 1) * GOLDEN)) to a sum modulo 2**64, so the terms can be
// summed in any order and split across any number of threads and CTAs and still match the
// sequential CPU definition bit for bit.  The grid is (KV blocks, chunks per block): each CTA sums
// one chunk of one block; with one chunk per block the CTA also applies the final mix, otherwise
// gdskv_checksum_finish folds the per-chunk partial sums.  Chunks exist so that a batch of a few
// large blocks still fills every SM.
//
// The file holds device code only, so NVRTC (CuPy RawModule) and `nvcc -c` both compile it; the
// kernels sit behind __CUDACC__ so the per-thread arithmetic can also be built as host C++ by the
// CPU test suite, which checks it against the Python definition without a GPU.

#define GDSKV_GOLDEN 0x9E3779B97F4A7C15ULL
#define GDSKV_LEN_MIX 0xC2B2AE3D27D4EB4FULL

__device__ __forceinline__ unsigned long long gdskv_fmix(unsigned long long x)
{
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

__device__ __forceinline__ unsigned long long gdskv_finish(unsigned long long sum, unsigned long long len)
{
    return gdskv_fmix(sum ^ (len * GDSKV_LEN_MIX));
}

// Chunks cover whole 16-byte pairs of words, so a chunk of a 16-byte aligned block starts
// 16-byte aligned and every thread can use vector loads.
__device__ __forceinline__ void gdskv_chunk_range(unsigned long long n_words, unsigned int chunks,
                                                  unsigned int chunk, unsigned long long* begin,
                                                  unsigned long long* end)
{
    unsigned long long n_pairs = (n_words + 1) / 2;
    unsigned long long per = (n_pairs + chunks - 1) / chunks * 2;
    unsigned long long b = per * chunk;
    unsigned long long e = b + per;
    *begin = b < n_words ? b : n_words;
    *end = e < n_words ? e : n_words;
}

#if defined(__CUDACC__)
// Non-coherent 16-byte load: the payload is not written while the kernel runs.
__device__ __forceinline__ void gdskv_load_pair(const unsigned char* p, unsigned long long* a,
                                                unsigned long long* b)
{
    asm("ld.global.nc.v2.u64 {%0, %1}, [%2];" : "=l"(*a), "=l"(*b) : "l"(p));
}
#else
__device__ __forceinline__ void gdskv_load_pair(const unsigned char* p, unsigned long long* a,
                                                unsigned long long* b)
{
    const unsigned long long* q = reinterpret_cast<const unsigned long long*>(p);
    *a = q[0];
    *b = q[1];
}
#endif

// A word read byte by byte: for a misaligned block, and for the zero-padded tail word, which
// must not read past the end of the payload.
__device__ __forceinline__ unsigned long long gdskv_load_bytes(const unsigned char* p, unsigned int n)
{
    unsigned long long w = 0;
    for (unsigned int k = 0; k < n; ++k) {
        w |= static_cast<unsigned long long>(p[k]) << (8 * k);
    }
    return w;
}

// Sum of the terms of words [begin, end) that fall to thread t of nt (thread t takes every
// nt-th unit of work).  `begin` is even.  The word at index len/8, if the range holds it, is the
// zero-padded tail.
__device__ unsigned long long gdskv_thread_sum(const unsigned char* base, unsigned long long len,
                                               unsigned long long begin, unsigned long long end,
                                               unsigned int t, unsigned int nt)
{
    unsigned long long full = len / 8;
    unsigned long long full_end = end < full ? end : full;
    unsigned long long sum = 0;
    unsigned long long align = reinterpret_cast<unsigned long long>(base);

    if (begin < full_end) {
        if ((align & 15) == 0) {
            // Pairs of words, four independent 16-byte loads in flight per thread.
            unsigned long long q = begin / 2 + t;
            unsigned long long q_end = begin / 2 + (full_end - begin) / 2;
            unsigned long long key = (2 * q + 1) * GDSKV_GOLDEN;  // key of word 2q
            const unsigned long long key_step = 2ULL * nt * GDSKV_GOLDEN;
            const unsigned long long stride = nt;
            for (; q + 3 * stride < q_end; q += 4 * stride) {
                unsigned long long a0, b0, a1, b1, a2, b2, a3, b3;
                gdskv_load_pair(base + 16 * q, &a0, &b0);
                gdskv_load_pair(base + 16 * (q + stride), &a1, &b1);
                gdskv_load_pair(base + 16 * (q + 2 * stride), &a2, &b2);
                gdskv_load_pair(base + 16 * (q + 3 * stride), &a3, &b3);
                sum += gdskv_fmix(a0 ^ key) + gdskv_fmix(b0 ^ (key + GDSKV_GOLDEN));
                key += key_step;
                sum += gdskv_fmix(a1 ^ key) + gdskv_fmix(b1 ^ (key + GDSKV_GOLDEN));
                key += key_step;
                sum += gdskv_fmix(a2 ^ key) + gdskv_fmix(b2 ^ (key + GDSKV_GOLDEN));
                key += key_step;
                sum += gdskv_fmix(a3 ^ key) + gdskv_fmix(b3 ^ (key + GDSKV_GOLDEN));
                key += key_step;
            }
            for (; q < q_end; q += stride) {
                unsigned long long a, b;
                gdskv_load_pair(base + 16 * q, &a, &b);
                sum += gdskv_fmix(a ^ key) + gdskv_fmix(b ^ (key + GDSKV_GOLDEN));
                key += key_step;
            }
            // An odd count of full words leaves one for the last thread.
            unsigned long long odd = begin + 2 * ((full_end - begin) / 2);
            if (odd < full_end && t == nt - 1) {
                const unsigned long long* w = reinterpret_cast<const unsigned long long*>(base + 8 * odd);
                sum += gdskv_fmix(*w ^ ((odd + 1) * GDSKV_GOLDEN));
            }
        } else if ((align & 7) == 0) {
            const unsigned long long* w = reinterpret_cast<const unsigned long long*>(base);
            for (unsigned long long i = begin + t; i < full_end; i += nt) {
                sum += gdskv_fmix(w[i] ^ ((i + 1) * GDSKV_GOLDEN));
            }
        } else {
            for (unsigned long long i = begin + t; i < full_end; i += nt) {
                sum += gdskv_fmix(gdskv_load_bytes(base + 8 * i, 8) ^ ((i + 1) * GDSKV_GOLDEN));
            }
        }
    }
    if ((len & 7) != 0 && begin <= full && full < end && t == 0) {
        sum += gdskv_fmix(gdskv_load_bytes(base + 8 * full, static_cast<unsigned int>(len & 7)) ^
                          ((full + 1) * GDSKV_GOLDEN));
    }
    return sum;
}

#if defined(__CUDACC__)
__device__ __forceinline__ unsigned long long gdskv_block_sum(unsigned long long v)
{
    __shared__ unsigned long long warp_sums[32];
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_down_sync(0xffffffffu, v, off);
    }
    const unsigned int lane = threadIdx.x & 31;
    const unsigned int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_sums[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        const unsigned int n_warps = (blockDim.x + 31) >> 5;
        v = lane < n_warps ? warp_sums[lane] : 0;
        for (int off = 16; off > 0; off >>= 1) {
            v += __shfl_down_sync(0xffffffffu, v, off);
        }
    }
    return v;  // valid in thread 0
}

// grid = (number of KV blocks, chunks per block); blockDim.x a multiple of 32, at most 1024.
// out[block * chunks + chunk] receives the chunk's partial sum, or the final checksum when
// there is one chunk per block.
extern "C" __global__ void __launch_bounds__(1024)
gdskv_checksum_partial(const unsigned long long* __restrict__ bases, unsigned long long len,
                       unsigned long long* __restrict__ out)
{
    const unsigned int block = blockIdx.x;
    const unsigned int chunk = blockIdx.y;
    const unsigned int chunks = gridDim.y;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(bases[block]);
    unsigned long long begin, end;
    gdskv_chunk_range((len + 7) / 8, chunks, chunk, &begin, &end);
    unsigned long long s = gdskv_block_sum(gdskv_thread_sum(base, len, begin, end, threadIdx.x, blockDim.x));
    if (threadIdx.x == 0) {
        out[static_cast<unsigned long long>(block) * chunks + chunk] = chunks == 1 ? gdskv_finish(s, len) : s;
    }
}

// One thread per KV block folds that block's `chunks` partial sums into its checksum.
extern "C" __global__ void gdskv_checksum_finish(const unsigned long long* __restrict__ partials,
                                                 unsigned int chunks, unsigned int n_blocks,
                                                 unsigned long long len,
                                                 unsigned long long* __restrict__ out)
{
    const unsigned int block = blockIdx.x * blockDim.x + threadIdx.x;
    if (block >= n_blocks) {
        return;
    }
    const unsigned long long* p = partials + static_cast<unsigned long long>(block) * chunks;
    unsigned long long s = 0;
    for (unsigned int c = 0; c < chunks; ++c) {
        s += p[c];
    }
    out[block] = gdskv_finish(s, len);
}
#endif
