/**
 * llama.cpp's SentencePiece (SPM, `tokenizer.ggml.model = "llama"`) tokenizer in plain TypeScript, read from the
 * GGUF's vocabulary: no node-llama-cpp on the start-up path of a run (importing it and its binary check, a child
 * process, cost ~0.7 s of CPU, more than an agent process). It follows llama.cpp's `llm_tokenizer_spm_session`
 * (highest-scoring bigram merges over UTF-8 characters, byte fallback) and `llama_detokenize` as node-llama-cpp calls
 * them (no BOS/EOS added, special tokens not parsed; control tokens decode to nothing), and node-llama-cpp's
 * detokenize-with-context. `spmVocabulary` accepts only vocabularies where that is the whole story — no user-defined
 * tokens, no special tokens besides BOS/EOS/UNK (llama.cpp finds end-of-turn tokens by their text), all 256 byte
 * tokens; any other vocabulary stays with node-llama-cpp (TokenizerLive). test/gguf/spmTokenizer.test.ts compares both.
 */
import type { GgufFile, GgufValue } from "../../domain/gguf.js"

/** GGUF `tokenizer.ggml.token_type` values. */
const TokenType = { Normal: 1, Unknown: 2, Control: 3, UserDefined: 4, Unused: 5, Byte: 6 } as const

export interface SpmVocabulary {
  /** Each token's text as UTF-8 bytes in a binary string (one char per byte). */
  readonly pieces: ReadonlyArray<string>
  readonly scores: ReadonlyArray<number>
  readonly types: ReadonlyArray<number>
  readonly bos: number
  readonly eos: number
  readonly addBos: boolean
  readonly addSpacePrefix: boolean
}

const binary = (text: string): string => Buffer.from(text, "utf8").toString("latin1")

const optionalInt = (file: GgufFile, key: string, fallback: number): number => {
  const value = file.metadata.get(key)
  return typeof value === "number" ? value : typeof value === "bigint" ? Number(value) : fallback
}
const optionalBool = (file: GgufFile, key: string, fallback: boolean): boolean => {
  const value = file.metadata.get(key)
  return typeof value === "boolean" ? value : fallback
}
const numbers = (value: GgufValue | undefined): ReadonlyArray<number> | undefined =>
  Array.isArray(value) && value.every((v) => typeof v === "number") ? (value as ReadonlyArray<number>) : undefined

/** Tokens whose text makes llama.cpp treat them as special (end of turn, fill-in-the-middle, ...). */
const specialLooking = /<[^<>]*>/
const byteToken = /^<0x[0-9A-F]{2}>$/

/** The vocabulary when this tokenizer reproduces llama.cpp's for it exactly; undefined for any other vocabulary. */
export const spmVocabulary = (file: GgufFile): SpmVocabulary | undefined => {
  if (file.metadata.get("tokenizer.ggml.model") !== "llama") return undefined
  const tokens = file.metadata.get("tokenizer.ggml.tokens")
  const scores = numbers(file.metadata.get("tokenizer.ggml.scores"))
  const types = numbers(file.metadata.get("tokenizer.ggml.token_type"))
  if (!Array.isArray(tokens) || !tokens.every((t) => typeof t === "string")) return undefined
  if (
    scores === undefined ||
    types === undefined ||
    scores.length !== tokens.length ||
    types.length !== tokens.length
  ) {
    return undefined
  }
  for (const key of ["eot", "eom", "sep", "pad", "cls", "mask"]) {
    if (file.metadata.has(`tokenizer.ggml.${key}_token_id`)) return undefined
  }
  if (file.metadata.has("tokenizer.ggml.eos_token_ids")) return undefined
  const bos = optionalInt(file, "tokenizer.ggml.bos_token_id", 1)
  const eos = optionalInt(file, "tokenizer.ggml.eos_token_id", 2)
  const unk = optionalInt(file, "tokenizer.ggml.unknown_token_id", 0)
  const texts = tokens as ReadonlyArray<string>
  if (![bos, eos, unk].every((id) => Number.isSafeInteger(id) && id >= 0 && id < texts.length)) return undefined
  let byteTokens = 0
  for (let id = 0; id < texts.length; id++) {
    const type = types[id]!
    const text = texts[id]!
    if (type === TokenType.Byte) {
      if (!byteToken.test(text)) return undefined
      byteTokens++
    } else if (type === TokenType.Control || type === TokenType.Unknown) {
      if (id !== bos && id !== eos && id !== unk) return undefined
    } else if (type === TokenType.Normal || type === TokenType.Unused) {
      if (specialLooking.test(text)) return undefined
    } else return undefined
  }
  if (byteTokens !== 256) return undefined
  return {
    pieces: texts.map(binary),
    scores,
    types,
    bos,
    eos,
    addBos: optionalBool(file, "tokenizer.ggml.add_bos_token", true),
    addSpacePrefix: optionalBool(file, "tokenizer.ggml.add_space_prefix", true)
  }
}

interface Symbol {
  start: number
  n: number
  prev: number
  next: number
}

interface Bigram {
  readonly left: number
  readonly right: number
  readonly score: number
  readonly size: number
}

/** llama.cpp's order: the highest score first, the leftmost among equal scores. */
const before = (a: Bigram, b: Bigram) => a.score > b.score || (a.score === b.score && a.left < b.left)

/** A binary heap of bigrams, `before` first. */
const makeQueue = () => {
  const heap: Array<Bigram> = []
  return {
    get size() {
      return heap.length
    },
    push: (item: Bigram) => {
      heap.push(item)
      let i = heap.length - 1
      while (i > 0) {
        const parent = (i - 1) >> 1
        if (!before(heap[i]!, heap[parent]!)) break
        ;[heap[i], heap[parent]] = [heap[parent]!, heap[i]!]
        i = parent
      }
    },
    pop: (): Bigram => {
      const top = heap[0]!
      const last = heap.pop()!
      if (heap.length > 0) {
        heap[0] = last
        let i = 0
        for (;;) {
          const l = 2 * i + 1
          const r = l + 1
          let best = i
          if (l < heap.length && before(heap[l]!, heap[best]!)) best = l
          if (r < heap.length && before(heap[r]!, heap[best]!)) best = r
          if (best === i) break
          ;[heap[i], heap[best]] = [heap[best]!, heap[i]!]
          i = best
        }
      }
      return top
    }
  }
}

const utf8Length = (lead: number) => [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4][lead >> 4]!

export interface SpmTokenizer {
  readonly vocabSize: number
  /** Text to ids as llama.cpp's `common_tokenize(vocab, text, add_special = false, parse_special = false)`. */
  readonly tokenize: (text: string) => Array<number>
  /** Ids to text as node-llama-cpp's `model.detokenize(tokens, false, context)`. */
  readonly detokenize: (tokens: ReadonlyArray<number>, context?: ReadonlyArray<number>) => string
}

/** A vocabulary's lookups: ids by piece, the id of each byte, and what each token decodes to. */
interface SpmTables {
  readonly vocab: SpmVocabulary
  readonly ids: ReadonlyMap<string, number>
  readonly byteIds: ReadonlyArray<number>
  /** What each token decodes to, as bytes in a binary string. */
  readonly decoded: ReadonlyArray<string>
}

const spmTables = (vocab: SpmVocabulary): SpmTables => {
  const ids = new Map<string, number>()
  vocab.pieces.forEach((piece, id) => ids.set(piece, id)) // a repeated text maps to its last id, as in llama.cpp
  const byteIds = Array.from({ length: 256 }, (_, b) => {
    const id = ids.get(`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`)
    return id ?? ids.get(String.fromCharCode(b))!
  })
  // What each token decodes to, as bytes in a binary string (llama.cpp's token_to_piece without special tokens).
  const space = binary("\u2581")
  const decoded = vocab.pieces.map((piece, id) => {
    const type = vocab.types[id]!
    if (type === TokenType.Normal) return piece.split(space).join(" ")
    if (type === TokenType.Byte) return String.fromCharCode(parseInt(piece.slice(3, 5), 16))
    return ""
  })
  return { vocab, ids, byteIds, decoded }
}

/** The escaped text's UTF-8 characters, each a symbol linked to its neighbours. */
const initialSymbols = (escaped: string): Array<Symbol> => {
  const symbols: Array<Symbol> = []
  for (let offset = 0; offset < escaped.length;) {
    const n = Math.min(utf8Length(escaped.charCodeAt(offset)), escaped.length - offset)
    const index = symbols.length
    symbols.push({ start: offset, n, prev: index - 1, next: offset + n === escaped.length ? -1 : index + 1 })
    offset += n
  }
  return symbols
}

/**
 * Merges neighbouring symbols whose joined text is a piece, the best-scored bigram first (llama.cpp's
 * llm_tokenizer_spm). Returns each merged piece's two halves, for resegmenting a piece that is not a token.
 */
const mergeBigrams = (t: SpmTables, escaped: string, symbols: Array<Symbol>) => {
  const queue = makeQueue()
  const revMerge = new Map<string, readonly [number, number]>()
  const tryAddBigram = (left: number, right: number) => {
    if (left === -1 || right === -1) return
    const l = symbols[left]!
    const piece = escaped.slice(l.start, l.start + l.n + symbols[right]!.n)
    const id = t.ids.get(piece)
    if (id === undefined) return
    queue.push({ left, right, score: t.vocab.scores[id]!, size: piece.length })
    revMerge.set(piece, [left, right])
  }
  for (let i = 1; i < symbols.length; i++) tryAddBigram(i - 1, i)
  while (queue.size > 0) {
    const bigram = queue.pop()
    const left = symbols[bigram.left]!
    const right = symbols[bigram.right]!
    if (left.n === 0 || right.n === 0 || left.n + right.n !== bigram.size) continue
    left.n += right.n
    right.n = 0
    left.next = right.next
    if (right.next >= 0) symbols[right.next]!.prev = bigram.left
    tryAddBigram(left.prev, bigram.left)
    tryAddBigram(bigram.left, left.next)
  }
  return revMerge
}

/** The ids of the merged symbols: a piece's id, else its halves', else its bytes'. */
const resegmentAll = (
  t: SpmTables,
  escaped: string,
  symbols: ReadonlyArray<Symbol>,
  revMerge: ReadonlyMap<string, readonly [number, number]>
): Array<number> => {
  const output: Array<number> = []
  const resegment = (symbol: Symbol) => {
    const piece = escaped.slice(symbol.start, symbol.start + symbol.n)
    const id = t.ids.get(piece)
    if (id !== undefined) {
      output.push(id)
      return
    }
    const merged = revMerge.get(piece)
    if (merged === undefined) {
      for (let j = 0; j < piece.length; j++) output.push(t.byteIds[piece.charCodeAt(j)]!)
      return
    }
    resegment(symbols[merged[0]]!)
    resegment(symbols[merged[1]]!)
  }
  for (let i = 0; i !== -1; i = symbols[i]!.next) resegment(symbols[i]!)
  return output
}

const tokenizeSpm = (t: SpmTables, text: string): Array<number> => {
  if (text === "") return []
  const escaped = binary((t.vocab.addSpacePrefix ? " " + text : text).replaceAll(" ", "\u2581"))
  const symbols = initialSymbols(escaped)
  const revMerge = mergeBigrams(t, escaped, symbols)
  return resegmentAll(t, escaped, symbols, revMerge)
}

// llama_detokenize(remove_special = false, unparse_special = false): the first token loses one leading space when
// the vocabulary adds a space prefix; bytes become text as node-llama-cpp's N-API string does (U+FFFD for bad UTF-8).
const rawDetokenize = (t: SpmTables, tokens: ReadonlyArray<number>): string => {
  let bytes = ""
  tokens.forEach((token, i) => {
    const piece = t.decoded[token] ?? ""
    bytes += i === 0 && t.vocab.addSpacePrefix && piece.startsWith(" ") ? piece.slice(1) : piece
  })
  return Buffer.from(bytes, "latin1").toString("utf8")
}

// node-llama-cpp's detokenize with context: decode the last 3 context tokens with the new ones, keep the new part.
const detokenizeSpm = (t: SpmTables, tokens: ReadonlyArray<number>, context?: ReadonlyArray<number>): string => {
  if (tokens.length === 0) return ""
  if (context === undefined || context.length === 0) return rawDetokenize(t, tokens)
  const added = context.slice(-3)
  const addedText = rawDetokenize(t, added)
  if (addedText === "") return rawDetokenize(t, tokens)
  const text = rawDetokenize(t, [...added, ...tokens])
  return text.startsWith(addedText) ? text.slice(addedText.length) : rawDetokenize(t, tokens)
}

export const makeSpmTokenizer = (vocab: SpmVocabulary): SpmTokenizer => {
  const t = spmTables(vocab)
  return {
    vocabSize: vocab.pieces.length,
    tokenize: (text) => tokenizeSpm(t, text),
    detokenize: (tokens, context) => detokenizeSpm(t, tokens, context)
  }
}
