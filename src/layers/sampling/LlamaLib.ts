/**
 * libllama's sampler API through koffi, over the `libllama` that the pinned node-llama-cpp ships beside ggml
 * (found in the directory `locateGgmlLibraries` finds; every platform package holds it under the same name).
 *
 * Only what the last stage's sampler chain needs: a vocab-only model load (tokenizer metadata, no weights), the
 * `llama_sampler_*` constructors, apply / accept / free. Native code aborts the process on a failed assertion, so
 * callers validate every value first (`samplingPolicyProblem` in services/RequestChecks.ts).
 */
import koffi, { type LibraryHandle } from "koffi"
import { readdirSync } from "node:fs"
import { join } from "node:path"
import { locateGgmlLibraries } from "../ggml/Platform.js"

/** An opaque native pointer as koffi hands it out. */
type NativePtr = unknown

/** Byte layout of `llama_token_data` ({ int32 id; float logit; float p; }) and `llama_token_data_array`. */
export const TokenDataLayout = { bytes: 12, id: 0, logit: 4, p: 8 } as const
export const TokenDataArrayLayout = { bytes: 32, data: 0, size: 8, selected: 16, sorted: 24 } as const

// long: a flat declaration table, one koffi binding per libllama function (llama.h's signature and its TypeScript type)
const declare = (lib: LibraryHandle) => {
  // llama.h of the pinned build (node-llama-cpp 3.21.1, llama.cpp release v0.4.0); enums are ints.
  const modelParams = koffi.struct("swactor_llama_model_params", {
    devices: "void *",
    tensor_buft_overrides: "void *",
    n_gpu_layers: "int32_t",
    split_mode: "int",
    load_mode: "int",
    lazy_mode: "int",
    main_gpu: "int32_t",
    tensor_split: "void *",
    progress_callback: "void *",
    progress_callback_user_data: "void *",
    kv_overrides: "void *",
    vocab_only: "bool",
    check_tensors: "bool",
    use_extra_bufts: "bool",
    no_host: "bool",
    no_alloc: "bool",
    load_mtp: "bool"
  })
  const chainParams = koffi.struct("swactor_llama_sampler_chain_params", { no_perf: "bool" })
  koffi.struct("swactor_llama_logit_bias", { token: "int32_t", bias: "float" })
  const f = (decl: string) => lib.func(decl)
  return {
    modelParams,
    llama_log_set: f("void llama_log_set(void * callback, void * user_data)") as (cb: unknown, ud: null) => void,
    llama_model_default_params: f("swactor_llama_model_params llama_model_default_params()") as () => Record<
      string,
      unknown
    >,
    llama_model_load_from_file: f(
      "void * llama_model_load_from_file(const char * path, swactor_llama_model_params params)"
    ) as (path: string, params: Record<string, unknown>) => NativePtr | null,
    llama_model_free: f("void llama_model_free(void * model)") as (model: NativePtr) => void,
    llama_model_get_vocab: f("void * llama_model_get_vocab(void * model)") as (model: NativePtr) => NativePtr,
    llama_vocab_n_tokens: f("int32_t llama_vocab_n_tokens(void * vocab)") as (vocab: NativePtr) => number,
    llama_vocab_is_eog: f("bool llama_vocab_is_eog(void * vocab, int32_t token)") as (
      vocab: NativePtr,
      token: number
    ) => boolean,
    llama_sampler_chain_default_params: f(
      "swactor_llama_sampler_chain_params llama_sampler_chain_default_params()"
    ) as () => Record<string, unknown>,
    llama_sampler_chain_init: f("void * llama_sampler_chain_init(swactor_llama_sampler_chain_params params)") as (
      params: Record<string, unknown>
    ) => NativePtr,
    llama_sampler_chain_add: f("void llama_sampler_chain_add(void * chain, void * smpl)") as (
      chain: NativePtr,
      smpl: NativePtr
    ) => void,
    llama_sampler_free: f("void llama_sampler_free(void * smpl)") as (smpl: NativePtr) => void,
    llama_sampler_apply: f("void llama_sampler_apply(void * smpl, void * cur_p)") as (
      smpl: NativePtr,
      curP: NativePtr
    ) => void,
    llama_sampler_accept: f("void llama_sampler_accept(void * smpl, int32_t token)") as (
      smpl: NativePtr,
      token: number
    ) => void,
    llama_sampler_init_greedy: f("void * llama_sampler_init_greedy()") as () => NativePtr,
    llama_sampler_init_dist: f("void * llama_sampler_init_dist(uint32_t seed)") as (seed: number) => NativePtr,
    llama_sampler_init_top_k: f("void * llama_sampler_init_top_k(int32_t k)") as (k: number) => NativePtr,
    llama_sampler_init_top_p: f("void * llama_sampler_init_top_p(float p, size_t min_keep)") as (
      p: number,
      minKeep: number
    ) => NativePtr,
    llama_sampler_init_min_p: f("void * llama_sampler_init_min_p(float p, size_t min_keep)") as (
      p: number,
      minKeep: number
    ) => NativePtr,
    llama_sampler_init_typical: f("void * llama_sampler_init_typical(float p, size_t min_keep)") as (
      p: number,
      minKeep: number
    ) => NativePtr,
    llama_sampler_init_temp: f("void * llama_sampler_init_temp(float t)") as (t: number) => NativePtr,
    llama_sampler_init_xtc: f("void * llama_sampler_init_xtc(float p, float t, size_t min_keep, uint32_t seed)") as (
      p: number,
      t: number,
      minKeep: number,
      seed: number
    ) => NativePtr,
    llama_sampler_init_penalties: f(
      "void * llama_sampler_init_penalties(int32_t n_vocab, int32_t last_n, float repeat, float freq, float present)"
    ) as (nVocab: number, lastN: number, repeat: number, freq: number, present: number) => NativePtr,
    llama_sampler_init_dry: f(
      "void * llama_sampler_init_dry(void * vocab, float mult, float base, int32_t allowed, int32_t last_n, const char ** breakers, size_t n)"
    ) as (
      vocab: NativePtr,
      multiplier: number,
      base: number,
      allowedLength: number,
      lastN: number,
      breakers: ReadonlyArray<string>,
      n: number
    ) => NativePtr,
    llama_sampler_init_logit_bias: f(
      "void * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n, const swactor_llama_logit_bias * biases)"
    ) as (nVocab: number, n: number, biases: ReadonlyArray<{ token: number; bias: number }>) => NativePtr,
    llama_sampler_init_grammar: f(
      "void * llama_sampler_init_grammar(void * vocab, const char * text, const char * root)"
    ) as (vocab: NativePtr, text: string, root: string) => NativePtr | null
  }
}

export type LlamaRaw = ReturnType<typeof declare>

/** Thrown when libllama cannot be found or loaded. */
export class LlamaLibError extends Error {
  override readonly name = "LlamaLibError"
}

let cached: LlamaRaw | undefined
/** While set, libllama's log lines go here instead of stderr (see `capturingLog`). */
let captured: Array<string> | undefined
let cachedError: LlamaLibError | undefined
let logCallback: unknown

const LLAMA_LIB = /^(lib)?llama(\.v[\d.]+)?\.(so|dylib|dll)$/

const load = (): LlamaRaw => {
  const located = locateGgmlLibraries()
  if ("tried" in located) {
    throw new LlamaLibError(`node-llama-cpp's libraries were not found; looked in: ${located.tried.join(", ")}`)
  }
  const name = readdirSync(located.dir).find((n) => LLAMA_LIB.test(n))
  if (name === undefined) throw new LlamaLibError(`no libllama in ${located.dir}`)
  let raw: LlamaRaw
  try {
    raw = declare(koffi.load(join(located.dir, name)))
  } catch (e) {
    throw new LlamaLibError(`cannot load ${join(located.dir, name)}: ${String(e)}`)
  }
  // llama_log_set also sets ggml's logger: keep warnings and errors (levels 3, 4 and their continuations).
  const proto = koffi.proto("void swactor_llama_log(int level, const char * text, void * user_data)")
  let last = 0
  logCallback = koffi.register((level: number, text: string | null) => {
    const effective = level === 5 ? last : level
    if (level !== 5) last = level
    if (text === null) return
    if (captured !== undefined) captured.push(text)
    else if (effective >= 3) process.stderr.write(text)
  }, koffi.pointer(proto))
  raw.llama_log_set(logCallback, null)
  return raw
}

/** libllama (loaded on first call). Throws LlamaLibError with a clear message when it cannot be loaded. */
export const getLlama = (): LlamaRaw => {
  if (cached !== undefined) return cached
  if (cachedError !== undefined) throw cachedError
  try {
    cached = load()
    return cached
  } catch (e) {
    cachedError = e instanceof LlamaLibError ? e : new LlamaLibError(String(e))
    throw cachedError
  }
}

/** A model's vocabulary, loaded vocab-only (no weights) and kept for the process's life. */
export interface LlamaVocab {
  readonly vocab: NativePtr
  readonly nTokens: number
  readonly isEndOfGeneration: (token: number) => boolean
}

const vocabs = new Map<string, LlamaVocab>()

/**
 * The vocabulary of the GGUF at `path` (a whole model or a stage's slice: both keep the tokenizer metadata), loaded
 * once per process and file. Throws LlamaLibError when libllama cannot read it.
 */
export const loadVocab = (path: string): LlamaVocab => {
  const known = vocabs.get(path)
  if (known !== undefined) return known
  const raw = getLlama()
  const params = { ...raw.llama_model_default_params(), vocab_only: true, use_extra_bufts: false }
  const { log, result: model } = capturingLog(() => raw.llama_model_load_from_file(path, params))
  if (model === null) {
    throw new LlamaLibError(`libllama could not load the vocabulary of ${path}: ${lastLines(log)}`)
  }
  const vocab = raw.llama_model_get_vocab(model)
  const eog = new Map<number, boolean>()
  const loaded: LlamaVocab = {
    vocab,
    nTokens: raw.llama_vocab_n_tokens(vocab),
    isEndOfGeneration: (token) => {
      let known = eog.get(token)
      if (known === undefined) eog.set(token, (known = raw.llama_vocab_is_eog(vocab, token)))
      return known
    }
  }
  vocabs.set(path, loaded)
  return loaded
}

/** Runs `f` with libllama's log lines collected instead of printed: its result and what it logged. */
export const capturingLog = <A>(f: () => A): { readonly result: A; readonly log: string } => {
  const lines: Array<string> = []
  captured = lines
  try {
    return { result: f(), log: lines.join("") }
  } finally {
    captured = undefined
  }
}

/** The last error lines of a log, on one line. */
export const lastLines = (log: string): string =>
  log
    .split("\n")
    .map((l) => l.trim())
    .filter((l) => l !== "")
    .slice(-3)
    .join("; ")
