// A small mixture-of-experts GGUF for placement tests: a synthetic llama (Synthetic.ts) whose chosen blocks trade
// their dense feed-forward for a router, stacked experts and a shared expert, the tensor names and shapes llama.cpp
// uses (blk.N.ffn_gate_inp.weight [n_embd, n_expert], blk.N.ffn_{gate,up}_exps.weight [n_embd, n_ff_exp, n_expert],
// blk.N.ffn_down_exps.weight [n_ff_exp, n_embd, n_expert], blk.N.ffn_*_shexp.weight) with `llama.expert_count` and
// `llama.expert_used_count`. Only its tensor table and metadata matter here: expert weights are zeros.
import { Effect } from "effect"
import { GgmlType, tensorBytes } from "../../src/domain/ggmlTypes.js"
import {
  type GgufTensorSpec,
  type GgufTypedValue,
  GgufValues,
  writeGgufFile
} from "../../src/layers/gguf/GgufWriter.js"
import { syntheticModelSpec } from "../../src/layers/gguf/Synthetic.js"

export interface MoeFileOptions {
  readonly path: string
  readonly layers: number
  /** Blocks whose feed-forward is a mixture of experts; the others stay dense. */
  readonly moeBlocks: ReadonlyArray<number>
  /** `llama.expert_count` (null: key left out). */
  readonly experts: number | null
  /** `llama.expert_used_count` (null: key left out). */
  readonly expertsUsed: number | null
  /** Experts stacked in the tensors (their last dimension); default `experts`. */
  readonly storedExperts?: number
  /** Hidden width of one expert. Default 128. */
  readonly expertFfn?: number
}

const HIDDEN = 64

export const writeMoeFile = (o: MoeFileOptions) =>
  Effect.gen(function* () {
    const base = syntheticModelSpec({
      path: o.path,
      arch: "llama",
      layers: o.layers,
      hidden: HIDDEN,
      ffn: 128,
      heads: 4,
      kvHeads: 2,
      vocab: 300,
      contextLength: 512,
      type: "f32",
      seed: 7
    })
    const stored = o.storedExperts ?? o.experts ?? 8
    const ff = o.expertFfn ?? 128
    const moe = new Set(o.moeBlocks)
    const zeros = (name: string, dims: ReadonlyArray<number>): GgufTensorSpec => ({
      name,
      type: GgmlType.F32,
      dims,
      data: () => new Uint8Array(tensorBytes(GgmlType.F32, dims))
    })
    const tensors: Array<GgufTensorSpec> = []
    for (const t of base.tensors) {
      const m = /^blk\.(\d+)\.ffn_(gate|up|down)\.weight$/.exec(t.name)
      if (m === null || !moe.has(Number(m[1]))) {
        tensors.push(t)
        continue
      }
      const b = `blk.${m[1]}`
      // One dense tensor's place takes its expert counterparts (the router with the gate).
      if (m[2] === "gate") {
        tensors.push(zeros(`${b}.ffn_gate_inp.weight`, [HIDDEN, stored]))
        tensors.push(zeros(`${b}.ffn_gate_exps.weight`, [HIDDEN, ff, stored]))
        tensors.push(zeros(`${b}.ffn_gate_shexp.weight`, [HIDDEN, ff]))
      } else if (m[2] === "up") {
        tensors.push(zeros(`${b}.ffn_up_exps.weight`, [HIDDEN, ff, stored]))
        tensors.push(zeros(`${b}.ffn_up_shexp.weight`, [HIDDEN, ff]))
      } else {
        tensors.push(zeros(`${b}.ffn_down_exps.weight`, [ff, HIDDEN, stored]))
        tensors.push(zeros(`${b}.ffn_down_shexp.weight`, [ff, HIDDEN]))
      }
    }
    const metadata: Array<readonly [string, GgufTypedValue]> = [...base.metadata]
    if (o.experts !== null) metadata.push(["llama.expert_count", GgufValues.u32(o.experts)])
    if (o.expertsUsed !== null) metadata.push(["llama.expert_used_count", GgufValues.u32(o.expertsUsed)])
    return yield* writeGgufFile(o.path, { metadata, tensors })
  })
