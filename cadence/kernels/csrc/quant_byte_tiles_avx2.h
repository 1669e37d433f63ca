/* Many rows of x (prefill, batches) against Q4_K and Q6_K blocks with AVX2 alone, in bytes.
 *
 * The float32 tiles (quant_matmul.c, "many rows of x") cost one FMA per 8
 * products. Here x's bytes (int8 steps, one step d_x per 256 values: see
 * "activations") meet the weights' integers w (Q4_K's nibbles 0..15, Q6_K's
 * 6-bit values minus 32) by maddubs, 32 products per instruction, and a
 * super-block's eight groups are summed in 32-bit integers, each run's
 * integer scale s applied by madd, before one conversion to float per
 * super-block:
 *
 *     out[r][c] = sum over super-blocks of  D[c] d_x[r] sum_h s_h[c] (w . q)_h[r][c]
 *                                          - dmin[c] d_x[r] sum_h m_h[c] (sum of q)_h[r]
 *
 * h running over the super-block's sixteen runs of 16 values; Q4_K: s the
 * groups' 6-bit scales, D = d, m its 6-bit mins (Q6_K has no such term). maddubs
 * takes one operand unsigned: x's, as q + 128 (1..255), so every sum starts
 * from -128 sum_h s_h (sum of w over run h), the weights' own (split by lanes,
 * so that no lane holds a large sum that the others cancel). Exact integer
 * sums: a maddubs pair is at most 2 x 255 x 32 (Q6_K), Q4_K's two halves' pairs
 * add to at most 4 x 255 x 15 before madd, a super-block's 32-bit sums stay
 * under 2^30. The decode path (quant_matmul.c, q4_k_byte_rows and
 * q6_k_byte_rows) multiplies the same integers, so both compute one product
 * up to the order of float32 sums.
 *
 * A tile is BYTE_TILE_ROWS = 8 weight rows, decoded BYTE_TILE_BLOCKS
 * super-blocks at a time into ByteBlocks (L1) that every row of x then meets;
 * each row's float accumulators wait in memory between the steps. In a
 * ByteBlock the rows come in pairs p (rows 2p, 2p + 1): a vector holds 16
 * values of each row of the pair, so that one broadcast half-group of x
 * meets both, and the sums' lanes 0..3 belong to row 2p, 4..7 to row 2p + 1.
 *
 * The includer defines BYTE_PRODUCTS and includes ggml_blocks.h and the
 * RoundedGroups of x first. */

#ifndef CADENCE_QUANT_BYTE_TILES_AVX2_H
#define CADENCE_QUANT_BYTE_TILES_AVX2_H

#define BYTE_TILE_ROWS 8
#define BYTE_TILE_PAIRS (BYTE_TILE_ROWS / 2)
/* Super-blocks decoded per step: a tile's 4 x 4.5 KiB stay in L1 while x's rows pass. */
#define BYTE_TILE_BLOCKS 4

/* One super-block of a tile's eight rows. */
typedef struct {
    /* group g, pair p, half h (values 16 h .. 16 h + 15 of the group): bytes 0..15
     * row 2p's w, bytes 16..31 row 2p + 1's */
    __m256i w[8][BYTE_TILE_PAIRS][2];
    /* the same places' integer scales s as 16-bit lanes (Q4_K: half 0's serve both) */
    __m256i scales[8][BYTE_TILE_PAIRS][2];
    /* Q4_K, run pair t (group t's halves): 16-bit lanes 2c, 2c + 1 = row c's m */
    __m256i mins[8];
    /* pair p's sums start from row 2p's bases in lanes 0..3, row 2p + 1's in lanes 4..7 */
    __m256i base[BYTE_TILE_PAIRS];
    __m256 d[BYTE_TILE_PAIRS]; /* lanes 0..3 row 2p's D, 4..7 row 2p + 1's */
    __m256 dmin;               /* lane c: row c's -dmin (Q4_K) */
} ByteBlock;

/* A row's accumulators: four for the pairs' sums (as the sums' lanes), one for its mins. */
typedef struct {
    __m256 sums[BYTE_TILE_PAIRS], mins;
} ByteAccumulators;

/* Super-block s of one weight row: its groups' w as 32 bytes each, the integer
 * scale and min of each run of 16 values (16-bit lanes 0..15), D, -dmin and the
 * sums' bases. */
typedef struct {
    __m256i w[8];
    __m256i scales, mins;
    float d, dmin;
    /* -128 sum_h s_h (sum of w over the values of run h that lane j of the sums
     * takes: 4 j .. 4 j + 3 of each half), so that each lane's sum is exact and
     * small before its conversion to float */
    int32_t base[4];
} RowBlock;

/* A shuffle_epi8 pattern: word ``low`` of the low 128-bit lane in all its words,
 * word ``high`` of the high lane in all of its. */
static inline __m256i word_picks(int low, int high) {
    return _mm256_setr_m128i(_mm_set1_epi16((short)((2 * low + 1) << 8 | 2 * low)),
                             _mm_set1_epi16((short)((2 * high + 1) << 8 | 2 * high)));
}

/* Runs 2 g (low 128-bit lane) and 2 g + 1 (high lane) of 16 run values, each
 * in all its lane's words. */
static inline __m256i group_runs(__m256i runs, int g) {
    const __m256i half = _mm256_permute4x64_epi64(runs, g < 4 ? 0x44 : 0xee); /* runs 0..7 or 8..15, twice */
    return _mm256_shuffle_epi8(half, word_picks((2 * g) % 8, (2 * g + 1) % 8));
}

/* The bases of a row's super-block, from its w and scales. */
static inline void row_block_bases(RowBlock *row) {
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i sums = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
        /* pairs of w (16-bit lane i: values 2 i, 2 i + 1), times the halves' scales
         * and summed in fours: 32-bit lane j values 4 j .. 4 j + 3 of half 0, j + 4 of half 1 */
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, row->w[g]), group_runs(row->scales, g)));
    }
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, sums);
    for (int j = 0; j < 4; ++j) row->base[j] = -128 * (lanes[j] + lanes[j + 4]);
}

static inline void row_block(int type, const uint8_t *row, int64_t s, RowBlock *out) {
    if (type == TYPE_Q4_K) {
        const uint8_t *block = row + s * 144;
        const __m256i low_nibble = _mm256_set1_epi8(15);
        for (int j = 0; j < 8; j += 2) {
            const __m256i pair = _mm256_loadu_si256((const __m256i *)(block + 16 + 16 * j));
            out->w[j] = _mm256_and_si256(pair, low_nibble);
            out->w[j + 1] = _mm256_and_si256(_mm256_srli_epi16(pair, 4), low_nibble);
        }
        const __m256i scales_and_mins = q4_k_scales_and_mins(block);
        out->scales = twice_each(_mm256_castsi256_si128(scales_and_mins));
        out->mins = twice_each(_mm256_extracti128_si256(scales_and_mins, 1));
        out->d = f16_at(block), out->dmin = -f16_at(block + 2);
    } else { /* Q6_K: the values minus 32, as signed bytes */
        const uint8_t *block = row + s * 210;
        const __m256i bias = _mm256_set1_epi8(32);
        for (int n = 0; n < 2; ++n) q6_k_half_bytes(block, n, out->w + 4 * n);
        for (int j = 0; j < 8; ++j) out->w[j] = _mm256_sub_epi8(out->w[j], bias);
        out->scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 192)));
        out->mins = _mm256_setzero_si256();
        out->d = f16_at(block + 208), out->dmin = 0.0f;
    }
    row_block_bases(out);
}

/* Super-blocks first .. first + count - 1 of ``rows`` (<= 8) weight rows into
 * blocks[0 .. count - 1]; rows past the last are zeros. */
static void decode_byte_blocks(int type, const uint8_t *weight, int64_t stride, int64_t rows, int64_t first,
                               int64_t count, ByteBlock *blocks) {
    static const RowBlock zero_row;
    for (int64_t i = 0; i < count; ++i) {
        ByteBlock *b = blocks + i;
        RowBlock row[BYTE_TILE_ROWS];
        for (int c = 0; c < BYTE_TILE_ROWS; ++c) {
            if (c < rows)
                row_block(type, weight + c * stride, first + i, &row[c]);
            else
                row[c] = zero_row;
        }
        if (type == TYPE_Q4_K) { /* mins[t]: 32-bit word t (group t's two runs) of each row's mins */
            __m256 words[8];
            for (int c = 0; c < BYTE_TILE_ROWS; ++c) words[c] = _mm256_castsi256_ps(row[c].mins);
            transpose8(words);
            for (int t = 0; t < 8; ++t) b->mins[t] = _mm256_castps_si256(words[t]);
            b->dmin = _mm256_setr_ps(row[0].dmin, row[1].dmin, row[2].dmin, row[3].dmin, row[4].dmin, row[5].dmin,
                                     row[6].dmin, row[7].dmin);
        }
        for (int p = 0; p < BYTE_TILE_PAIRS; ++p) {
            const RowBlock *first_row = &row[2 * p], *second_row = &row[2 * p + 1];
            b->base[p] = _mm256_setr_epi32(first_row->base[0], first_row->base[1], first_row->base[2], first_row->base[3],
                                           second_row->base[0], second_row->base[1], second_row->base[2],
                                           second_row->base[3]);
            b->d[p] = _mm256_setr_ps(first_row->d, first_row->d, first_row->d, first_row->d, second_row->d,
                                     second_row->d, second_row->d, second_row->d);
            /* runs 0..7 of both rows (low lane: the first's), then runs 8..15 */
            const __m256i runs[2] = {_mm256_permute2x128_si256(first_row->scales, second_row->scales, 0x20),
                                     _mm256_permute2x128_si256(first_row->scales, second_row->scales, 0x31)};
            for (int g = 0; g < 8; ++g)
                for (int h = 0; h < 2; ++h) {
                    const int run = 2 * g + h;
                    b->w[g][p][h] = _mm256_permute2x128_si256(first_row->w[g], second_row->w[g], h ? 0x31 : 0x20);
                    if (type == TYPE_Q6_K || h == 0) /* Q4_K's halves share their scale */
                        b->scales[g][p][h] = _mm256_shuffle_epi8(runs[run / 8], word_picks(run % 8, run % 8));
                }
        }
    }
}

/* One row of x against ``count`` decoded super-blocks: q, half_q and d_x point at
 * its first of them in x's q8, half_q and d (a row's super-blocks follow one
 * another there), acc is its accumulators, updated. One row at a time: x's two
 * broadcast halves of a group meet every pair's bytes straight from L1 (with two
 * rows the sums no longer fit the registers, measured 15% slower on the AVX2
 * EPYC). */
static inline __attribute__((always_inline)) void byte_block_row(int type, const ByteBlock *blocks, int64_t count,
                                                                const int8_t *q, const int16_t *half_q,
                                                                const float *d_x, ByteAccumulators *acc) {
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    for (int64_t i = 0; i < count; ++i) {
        const ByteBlock *b = blocks + i;
        __m256i sums[BYTE_TILE_PAIRS];
        for (int p = 0; p < BYTE_TILE_PAIRS; ++p) sums[p] = _mm256_load_si256(&b->base[p]);
        for (int g = 0; g < 8; ++g) {
            __m256i x[2]; /* the group's halves as q + 128 (unsigned), each in both 128-bit lanes */
            for (int h = 0; h < 2; ++h)
                x[h] = _mm256_xor_si256(
                    sign, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + i * 256 + g * GROUP + 16 * h))));
            for (int p = 0; p < BYTE_TILE_PAIRS; ++p) {
                const __m256i first = _mm256_maddubs_epi16(x[0], b->w[g][p][0]);
                const __m256i second = _mm256_maddubs_epi16(x[1], b->w[g][p][1]);
                if (type == TYPE_Q4_K) /* one scale a group: its halves' pairs add first */
                    sums[p] = _mm256_add_epi32(sums[p], _mm256_madd_epi16(_mm256_add_epi16(first, second),
                                                                          b->scales[g][p][0]));
                else
                    sums[p] = _mm256_add_epi32(sums[p], _mm256_add_epi32(_mm256_madd_epi16(first, b->scales[g][p][0]),
                                                                         _mm256_madd_epi16(second, b->scales[g][p][1])));
            }
        }
        const __m256 step = _mm256_set1_ps(d_x[i * 8]);
        for (int p = 0; p < BYTE_TILE_PAIRS; ++p)
            acc->sums[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[p]), _mm256_mul_ps(b->d[p], step), acc->sums[p]);
        if (type != TYPE_Q4_K) continue; /* Q6_K's bias is in its signed bytes */
        __m256i mins = _mm256_setzero_si256();
        for (int t = 0; t < 8; ++t) {
            int32_t run_pair;
            memcpy(&run_pair, half_q + i * 16 + 2 * t, sizeof run_pair);
            mins = _mm256_add_epi32(mins, _mm256_madd_epi16(b->mins[t], _mm256_set1_epi32(run_pair)));
        }
        acc->mins = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(b->dmin, step), acc->mins);
    }
}

/* A row's accumulators summed into its eight outputs (lane c: weight row c). */
static inline __m256 byte_outputs(const ByteAccumulators *acc) {
    /* hadd of pairs 0, 1: rows 0 0 2 2 | 1 1 3 3; of those two: rows 0 2 4 6 | 1 3 5 7 */
    const __m256 low = _mm256_hadd_ps(acc->sums[0], acc->sums[1]), high = _mm256_hadd_ps(acc->sums[2], acc->sums[3]);
    const __m256 rows = _mm256_permutevar8x32_ps(_mm256_hadd_ps(low, high), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return _mm256_add_ps(rows, acc->mins);
}

/* Tiles of a panel: the weight rows one thread decodes a step of super-blocks
 * for (64 rows x 4 super-blocks, 144 KiB, in L2) before x's rows pass them. */
#define BYTE_PANEL_TILES 8
#define BYTE_PANEL_ROWS (BYTE_PANEL_TILES * BYTE_TILE_ROWS)
/* Rows of x that meet one tile (in L1) before the next tile: their bytes of the
 * step (16 x 1 KiB) stay in L1 too. */
#define BYTE_ROW_BLOCK 16

/* Bytes of one thread's buffer: a panel's decoded step. */
static inline int64_t byte_panel_bytes(int64_t groups) {
    (void)groups; /* a panel holds a step of super-blocks, whatever the row's length */
    return BYTE_PANEL_TILES * BYTE_TILE_BLOCKS * (int64_t)sizeof(ByteBlock);
}

/* out[0:m, 0:rows] (row stride os) for the ``rows`` (<= BYTE_PANEL_ROWS) weight rows
 * at ``weight``, x's rows rounded for the type (``groups`` groups each). Each row's
 * value is the sum, step by step, of the same per-step sums whatever m is. */
static void multiply_byte_panel(int type, const uint8_t *weight, int64_t stride, int64_t rows, int64_t groups,
                                const RoundedGroups *x, int64_t m, void *buffer, float *out, int64_t os) {
    ByteBlock *blocks = (ByteBlock *)buffer; /* tile j's step at blocks + j * BYTE_TILE_BLOCKS */
    const int64_t super_blocks = groups / 8, tiles = (rows + BYTE_TILE_ROWS - 1) / BYTE_TILE_ROWS;
    for (int64_t first = 0; first < super_blocks; first += BYTE_TILE_BLOCKS) {
        const int64_t count = super_blocks - first < BYTE_TILE_BLOCKS ? super_blocks - first : BYTE_TILE_BLOCKS;
        for (int64_t j = 0; j < tiles; ++j) {
            const int64_t tile_rows = rows - j * BYTE_TILE_ROWS < BYTE_TILE_ROWS ? rows - j * BYTE_TILE_ROWS : BYTE_TILE_ROWS;
            decode_byte_blocks(type, weight + j * BYTE_TILE_ROWS * stride, stride, tile_rows, first, count,
                               blocks + j * BYTE_TILE_BLOCKS);
        }
        for (int64_t r0 = 0; r0 < m; r0 += BYTE_ROW_BLOCK) {
            const int64_t r_end = r0 + BYTE_ROW_BLOCK < m ? r0 + BYTE_ROW_BLOCK : m;
            for (int64_t j = 0; j < tiles; ++j) {
                const int64_t cols = rows - j * BYTE_TILE_ROWS < BYTE_TILE_ROWS ? rows - j * BYTE_TILE_ROWS : BYTE_TILE_ROWS;
                for (int64_t r = r0; r < r_end; ++r) {
                    const int64_t group = r * groups + first * 8;
                    const int8_t *q = x->q8 + group * GROUP;
                    ByteAccumulators acc;
                    memset(&acc, 0, sizeof acc);
                    if (type == TYPE_Q4_K)
                        byte_block_row(TYPE_Q4_K, blocks + j * BYTE_TILE_BLOCKS, count, q, x->half_q + 2 * group,
                                       x->d + group, &acc);
                    else
                        byte_block_row(TYPE_Q6_K, blocks + j * BYTE_TILE_BLOCKS, count, q, x->half_q + 2 * group,
                                       x->d + group, &acc);
                    float values[BYTE_TILE_ROWS] __attribute__((aligned(32)));
                    _mm256_store_ps(values, byte_outputs(&acc));
                    float *row_out = out + r * os + j * BYTE_TILE_ROWS;
                    for (int64_t c = 0; c < cols; ++c) row_out[c] = first ? row_out[c] + values[c] : values[c];
                }
            }
        }
    }
}

#endif
