/**
 * llama.cpp's own quantizer (`llama_model_quantize` of the libllama node-llama-cpp ships, through koffi): the outside
 * oracle for the per-tensor types of swactor synth's mixed recipes (q4_k_m, q3_k_m).
 */
import koffi from "koffi"
import { readdirSync } from "node:fs"
import { join } from "node:path"
import { getGgml } from "../../src/layers/ggml/Bindings.js"

interface Quantizer {
  readonly defaults: () => Record<string, unknown>
  readonly quantize: (input: string, output: string, params: Record<string, unknown>) => number
  readonly logSet: (callback: unknown, userData: null) => void
  readonly quiet: unknown
}

let quantizer: Quantizer | undefined

const load = (): Quantizer => {
  if (quantizer !== undefined) return quantizer
  const g = getGgml()
  g.cpuDevice() // backends loaded (libllama's loader asks the CPU device for buffer types)
  const name = readdirSync(g.library.dir).find((f) => /^(lib)?llama(\.v[\d.]+)?\.(so|dylib|dll)$/.test(f))
  if (name === undefined) throw new Error(`no libllama in ${g.library.dir}`)
  const lib = koffi.load(join(g.library.dir, name))
  // llama.h of the pinned build (/tmp/llama-src/include/llama.h): llama_model_quantize_params
  koffi.struct("swactor_test_quantize_params", {
    nthread: "int32_t",
    ftype: "int32_t",
    output_tensor_type: "int32_t",
    token_embedding_type: "int32_t",
    allow_requantize: "bool",
    quantize_output_tensor: "bool",
    only_copy: "bool",
    pure: "bool",
    keep_split: "bool",
    dry_run: "bool",
    imatrix: "void *",
    kv_overrides: "void *",
    tt_overrides: "void *",
    prune_layers: "void *",
    max_buf_size: "size_t"
  })
  const logProto = koffi.proto("void swactor_test_llama_log(int level, const char * text, void * user_data)")
  quantizer = {
    logSet: lib.func("void llama_log_set(void * callback, void * user_data)") as never,
    quiet: koffi.register(() => {}, koffi.pointer(logProto)),
    defaults: lib.func("swactor_test_quantize_params llama_model_quantize_default_params()") as never,
    quantize: lib.func(
      "uint32_t llama_model_quantize(const char * fname_inp, const char * fname_out, const swactor_test_quantize_params * params)"
    ) as never
  }
  return quantizer
}

/** Quantizes the GGUF at `input` to llama_ftype `ftype` with llama.cpp's rules, into `output`; one thread. */
export const llamaQuantize = (input: string, output: string, ftype: number): void => {
  const q = load()
  q.logSet(q.quiet, null) // its per-tensor lines, not the test's output
  let rc: number
  try {
    rc = q.quantize(input, output, { ...q.defaults(), nthread: 1, ftype })
  } finally {
    q.logSet(null, null)
  }
  if (rc !== 0) throw new Error(`llama_model_quantize(${input}, ftype ${ftype}) returned ${rc}`)
}
