/**
 * How a prompt's rows travel between stages: in pieces, each sent on as soon as its stage computed it, so that stage
 * s + 1 works on piece i while stage s works on piece i + 1 (a pipelined prefill: a prompt of K pieces through S
 * stages takes about K + S - 1 piece times instead of K * S).
 *
 * The pieces never change the numbers a stage computes (measured on the ggml CPU backend this package ships, against
 * the whole prompt in one call, test/agent/promptPieces.test.ts):
 * - ggml's CPU flash attention takes a tiled kernel from 64 query rows on and a row kernel below, which round
 *   differently; matrix products of 2+ rows go to llamafile's tinyBLAS, of one row to the vec_dot kernel (F32 / F16
 *   round differently); repacked Q4_K takes 4-row gemm groups. A piece of 64 rows or more inside a batcher chunk of
 *   128 or more gives exactly the bits of the whole chunk; smaller pieces do not, for every weight type.
 * - So a batcher chunk (StageBatcher `prefillChunk`: a prompt from `startPos` runs as [startPos, startPos + C), ...)
 *   of m >= 128 rows is cut into floor(m / 64) pieces as equal as possible (each 64 rows or more), a shorter chunk
 *   travels whole. A prompt under 128 rows is one piece, as before: on a CPU its rows cost far less than their number
 *   of one-row steps (measured: 5 rows about 1.7x one), so cutting it would delay the first token, not hasten it.
 * - A resumed generation's replayed tokens (`replayTail`) travel one row per piece: each runs alone, as the decode
 *   step that produced it did (StageBatcher's replayTail, done by the pieces instead).
 * - A piece never exceeds the edge's window (`windowRows`): a ring smaller than 64 rows (only a hand-made plan has
 *   one) gets pieces of the window's rows, which keeps the order and the content but not the bits above.
 */

/** The smallest piece of a cut chunk (ggml's tiled flash attention from 64 query rows). */
export const MIN_PIECE_ROWS = 64

/**
 * The sizes of the pieces a prompt of `rows` rows travels in (they sum to `rows`), for a batcher chunk of `chunk`
 * rows, the last `replayTail` rows one per piece, no piece above `windowRows` (at least 1).
 */
export const promptPieces = (rows: number, chunk: number, replayTail = 0, windowRows = Infinity): Array<number> => {
  const tail = Math.max(0, Math.min(replayTail, rows - 1))
  const body = rows - tail
  const pieces: Array<number> = []
  for (let at = 0; at < body; at += chunk) {
    const m = Math.min(chunk, body - at)
    const count = m >= 2 * MIN_PIECE_ROWS ? Math.floor(m / MIN_PIECE_ROWS) : 1
    const base = Math.floor(m / count)
    for (let i = 0; i < count; i++) pieces.push(base + (i < m % count ? 1 : 0))
  }
  for (let i = 0; i < tail; i++) pieces.push(1)
  const cap = Math.max(1, Math.floor(windowRows))
  if (pieces.every((p) => p <= cap)) return pieces
  return pieces.flatMap((p) => {
    const parts: Array<number> = []
    for (let left = p; left > 0; left -= cap) parts.push(Math.min(cap, left))
    return parts
  })
}
