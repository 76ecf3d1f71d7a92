/**
 * The tensors of a synthetic model, taken from the architecture's own declaration (src/layers/engine/archs/*: an
 * ArchModule's blockTensors, sharedTensors, inputTensors, outputTensors) with the shapes the engine derives from the
 * file's metadata: the metadata is read back through the engine's own hyperparameter reader (readModelHParams), so a
 * synthetic file holds exactly what the engine declares for it.
 *
 * Written: the model head (token_embd, output_norm, output unless tied: StageLayout's), the required model-wide
 * tensors, then per block its required tensors, the optional ones the architecture's `fileFacts` entry picks, and on a
 * multi-token-prediction block (past the trunk, which the engine never loads) the nextn.* tensors (SyntheticNextn.ts).
 *
 * What the declaration cannot say is kept per architecture in `fileFacts`, one entry each: which optional tensors the
 * file carries, where the file's order differs from the engine's load order (the order llama.cpp's converters write),
 * whether routed experts come fused (`ffn_gate_up_exps`, which the engine reads from the file), whether blocks that
 * read another block's KV cache still carry their own K/V (the engine skips them) and the spread of the biases.
 * The values each tensor is drawn from (mean and deviation) follow its name and kind (`initOf`).
 */
import { Effect } from "effect"
import type { GgufFile, GgufTensorInfo } from "../../domain/gguf.js"
import type { HParams } from "../engine/HParams.js"
import { readModelHParams } from "../engine/StageLayout.js"
import type { TensorSpec } from "../engine/Toolkit.js"
import type { GgufTypedValue } from "./GgufWriter.js"
import type { SyntheticGemma4Options } from "./SyntheticGemma4.js"
import { nextnBlockTensors } from "./SyntheticNextn.js"

/** One tensor to write: full name, shape, kind (a vector is stored F32) and the distribution of its values. */
interface SyntheticTensor {
  readonly name: string
  readonly dims: ReadonlyArray<number>
  readonly kind: TensorSpec["kind"]
  readonly mean: number
  readonly std: number
}

/** What the planner needs of the synthetic options. */
interface SyntheticTensorOptions extends SyntheticGemma4Options {
  readonly arch: string
  readonly layers: number
  readonly hidden: number
  readonly vocab: number
  readonly nextnLayers?: number
  readonly tiedOutput?: boolean
  readonly experts?: number
}

/** Short names placed just before (or after) another tensor of the block, in this order. */
type Move =
  | { readonly names: ReadonlyArray<string>; readonly before: string }
  | { readonly names: ReadonlyArray<string>; readonly after: string }

/** How an architecture's synthetic file differs from what its engine module declares (see the module comment). */
interface FileFacts {
  /** Optional tensors of block `il` the file carries (required ones are always written). */
  readonly optional?: (name: string, il: number, hp: HParams, o: SyntheticTensorOptions) => boolean
  /** From the engine's load order to the file's. */
  readonly moves?: ReadonlyArray<Move>
  /** Routed blocks hold gate and up fused (`ffn_gate_up_exps`). */
  readonly fusedGateUp?: boolean
  /** Blocks that read an earlier block's KV cache carry their own K/V tensors all the same. */
  readonly ownKv?: boolean
  /** The deviation of biases (default 0.02). */
  readonly biasStd?: number
}

const qkNorms = ["attn_q_norm.weight", "attn_k_norm.weight"]
const qkvBiases = new Set(["attn_q.bias", "attn_k.bias", "attn_v.bias"])
const gemmaNorms = [...qkNorms, "post_attention_norm.weight", "post_ffw_norm.weight"]

const fileFacts: Readonly<Record<string, FileFacts>> = {
  qwen3: { moves: [{ names: qkNorms, before: "attn_output.weight" }] },
  qwen3moe: { moves: [{ names: qkNorms, before: "attn_output.weight" }] },
  gemma3: { moves: [{ names: gemmaNorms, before: "attn_output.weight" }] },
  gemma4: {
    // attn_v but on a global block with kEqV (V is K's projection there, as Gemma 4 ships them)
    optional: (name, il, hp, o) =>
      name === "attn_v.weight"
        ? !(o.kEqV === true && hp.swa !== undefined && !hp.swa.layers[il])
        : name === "layer_output_scale.weight" || name === "ffn_down_exps.scale",
    moves: [
      {
        names: [...gemmaNorms, "layer_output_scale.weight", "inp_gate.weight", "proj.weight", "post_norm.weight"],
        before: "attn_output.weight"
      },
      { names: ["ffn_gate_inp.scale"], after: "ffn_gate_inp.weight" },
      { names: ["ffn_down_exps.scale"], after: "ffn_down_exps.weight" }
    ],
    fusedGateUp: true,
    ownKv: true
  },
  glm4moe: {
    optional: (name) => qkvBiases.has(name),
    moves: [
      { names: ["post_attention_norm.weight"], after: "attn_output.weight" },
      { names: ["exp_probs_b.bias"], before: "ffn_gate_shexp.weight" }
    ]
  },
  deepseek2: {
    optional: (name) => name === "exp_probs_b.bias",
    moves: [{ names: ["exp_probs_b.bias"], before: "ffn_gate_shexp.weight" }]
  },
  "gpt-oss": {
    optional: (name) => qkvBiases.has(name),
    moves: [{ names: [...qkvBiases], after: "attn_output.weight" }],
    biasStd: 0.1
  },
  qwen35moe: { moves: [{ names: ["post_attention_norm.weight"], before: "ffn_gate_inp.weight" }] }
}

const factsOf = (arch: string): FileFacts => fileFacts[arch] ?? {}

/** The block's tensors in the file's order: each move takes its names out and puts them back beside its anchor. */
const fileOrder = (specs: ReadonlyArray<TensorSpec>, moves: ReadonlyArray<Move>): ReadonlyArray<TensorSpec> =>
  moves.reduce((order, move) => {
    const moved = move.names.flatMap((n) => order.filter((s) => s.name === n))
    const rest = order.filter((s) => !move.names.includes(s.name))
    const anchor = rest.findIndex((s) => s.name === ("before" in move ? move.before : move.after))
    if (moved.length === 0 || anchor < 0) return order
    const at = "before" in move ? anchor : anchor + 1
    return [...rest.slice(0, at), ...moved, ...rest.slice(at)]
  }, specs)

/** Values of a named tensor that are not a projection's N(0, 1/sqrt(fan_in)) nor a norm's 1 + N(0, 0.1). */
const ownInit: ReadonlyMap<string, readonly [mean: number, std: number]> = new Map([
  ["token_embd.weight", [0, 0.02]],
  ["per_layer_token_embd.weight", [0, 0.1]],
  ["rope_freqs.weight", [1.5, 0.5]],
  ["layer_output_scale.weight", [1, 0.2]],
  ["ffn_gate_inp.scale", [1, 0.2]],
  ["ffn_down_exps.scale", [1, 0.3]],
  ["attn_sinks.weight", [0, 1]],
  ["ffn_gate_inp.bias", [0, 0.5]],
  ["exp_probs_b.bias", [0, 0.1]],
  // -exp(A_log): negative, so every step decays the state
  ["ssm_a", [-0.5, 0.05]],
  ["ssm_dt.bias", [0, 0.5]]
])

/** The distribution of tensor `name` (short or full) of this kind and shape. */
const initOf = (name: string, spec: Pick<TensorSpec, "dims" | "kind">, facts: FileFacts): SyntheticTensor => {
  const short = name.replace(/^blk\.\d+\./, "")
  const own = ownInit.get(short)
  const [mean, std] =
    own ??
    (spec.kind === "matrix" || short === "ssm_conv1d.weight"
      ? [0, 1 / Math.sqrt(spec.dims[0]!)]
      : short.endsWith(".bias")
        ? [0, facts.biasStd ?? 0.02]
        : [1, 0.1])
  return { name, dims: spec.dims, kind: spec.kind, mean, std }
}

/** The tensor table the engine's hyperparameter reader consults beside the metadata (see readHints). */
const tensorInfo = (name: string, dims: ReadonlyArray<number>): GgufTensorInfo => ({
  name,
  type: 0,
  dims,
  offset: 0,
  byteSize: 0
})

/**
 * The tensors the engine's hyperparameter reader looks at: the output head (gpt-oss requires its own) and, where the
 * experts come fused, every block's `ffn_gate_up_exps` (Moe.ts tells fused from apart by it).
 */
const readHints = (o: SyntheticTensorOptions, blocks: number): ReadonlyArray<GgufTensorInfo> => [
  ...(o.tiedOutput === true ? [] : [tensorInfo("output.weight", [o.hidden, o.vocab])]),
  ...(factsOf(o.arch).fusedGateUp === true
    ? Array.from({ length: blocks }, (_, il) =>
        tensorInfo(`blk.${il}.ffn_gate_up_exps.weight`, [o.hidden, 0, o.experts ?? 0])
      )
    : [])
]

/** The engine's hyperparameters of a file with this metadata (an internal error if the engine refuses it). */
const hparamsOf = (
  metadata: ReadonlyArray<readonly [string, GgufTypedValue]>,
  hints: ReadonlyArray<GgufTensorInfo>
) => {
  const file: GgufFile = {
    path: "(synthetic)",
    version: 3,
    alignment: 32,
    dataOffset: 0,
    fileSize: 0,
    metadata: new Map(metadata.map(([k, v]) => [k, v.value])),
    metadataTypes: new Map(
      metadata.map(([k, v]) => [
        k,
        v.itemType === undefined ? { type: v.type } : { type: v.type, itemType: v.itemType }
      ])
    ),
    tensors: hints,
    tensorsByName: new Map(hints.map((t) => [t.name, t]))
  }
  return Effect.runSync(
    readModelHParams(file).pipe(
      Effect.catchAll((e) =>
        Effect.die(new Error(`the engine refuses a synthetic ${String(metadata[0]?.[1].value)}: ${e.message}`))
      )
    )
  )
}

/** The hyperparameters blocks are declared with: gemma4's shared-KV blocks as if they had their own cache. */
const declaredWith = (hp: HParams, facts: FileFacts): HParams => {
  if (facts.ownKv !== true || hp.kvShare === undefined) return hp
  const { kvShare: _shared, ...own } = hp
  return own
}

/**
 * The tensors of a synthetic model in file order, from the architecture's declaration; `metadata` is the file's
 * (its block count includes the MTP blocks).
 */
export const plannedTensors = (
  o: SyntheticTensorOptions,
  metadata: ReadonlyArray<readonly [string, GgufTypedValue]>
): ReadonlyArray<SyntheticTensor> => {
  const blocks = o.layers + (o.nextnLayers ?? 0)
  const facts = factsOf(o.arch)
  const { arch, hp } = hparamsOf(metadata, readHints(o, blocks))
  const written = (s: TensorSpec, il: number) => s.required || (facts.optional?.(s.name, il, hp, o) ?? false)
  // the model head as StageLayout declares it
  const embd = { dims: [hp.nEmbd, hp.nVocab], kind: "matrix" } as const
  const out: Array<SyntheticTensor> = [
    initOf("token_embd.weight", embd, facts),
    initOf("output_norm.weight", { dims: [hp.nEmbd], kind: "vector" }, facts),
    ...(o.tiedOutput === true ? [] : [initOf("output.weight", embd, facts)])
  ]
  for (const s of [...(arch.sharedTensors?.(hp) ?? []), ...(arch.inputTensors?.(hp) ?? [])])
    if (s.required) out.push(initOf(s.name, s, facts))
  const declared = declaredWith(hp, facts)
  for (let il = 0; il < blocks; il++) {
    const b = `blk.${il}`
    const specs = fileOrder(
      arch.blockTensors(declared, il).filter((s) => written(s, il)),
      facts.moves ?? []
    )
    // an MTP block (nextnLayers): its nextn.* tensors right after attn_norm
    const mtp = il < o.layers ? [] : nextnBlockTensors(b, o.hidden)
    specs.forEach((s, i) => {
      out.push(initOf(`${b}.${s.name}`, s, facts))
      if (i === 0)
        for (const [name, dims, kind] of mtp)
          out.push(initOf(name, { dims, kind: kind === "norm" ? "vector" : kind }, facts))
    })
  }
  for (const s of arch.outputTensors?.(hp) ?? []) if (s.required) out.push(initOf(s.name, s, facts))
  return out
}
