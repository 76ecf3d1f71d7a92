/**
 * Every architecture's synthetic file against the engine's own declaration of its tensors (ArchModule.blockTensors,
 * sharedTensors, inputTensors, outputTensors, and StageLayout's model head), read through the engine's hyperparameter
 * reader from the file's metadata: each required tensor is in the file with the declared shape, each tensor of the
 * file is one the engine declares (a vector one stored F32), save the multi-token-prediction blocks past the trunk
 * (the engine never loads them) and gemma4's shared-KV blocks' own K/V (llama.cpp does not require them there).
 */
import { Effect } from "effect"
import { describe, expect, it } from "vitest"
import { GgmlType } from "../../src/domain/ggmlTypes.js"
import type { GgufFile, GgufTensorInfo } from "../../src/domain/gguf.js"
import type { TensorSpec } from "../../src/layers/engine/Toolkit.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import {
  syntheticArchs,
  syntheticModelSpec,
  type SyntheticModelOptions,
  validateSyntheticModel
} from "../../src/layers/gguf/Synthetic.js"

const base = (arch: SyntheticModelOptions["arch"]): SyntheticModelOptions => ({
  path: "unused.gguf",
  arch,
  layers: 4,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  vocab: 300,
  contextLength: 512,
  type: "q8_0",
  seed: 1
})

/** Options that change the tensor set, per architecture (each also runs on the defaults). */
const variants: Partial<Record<SyntheticModelOptions["arch"], ReadonlyArray<Partial<SyntheticModelOptions>>>> = {
  llama: [{ tiedOutput: true }, { headDim: 32 }],
  qwen3: [{ headDim: 128, kvHeads: 1 }],
  gemma3: [{ swaPattern: 2 }],
  gemma4: [
    { kEqV: true, swaPattern: 2 },
    { perLayerEmbd: 64 },
    { sharedKvLayers: 3, layers: 9, swaPattern: 3 },
    { sharedKvLayers: 4, layers: 8, swaPattern: 4, doubleWideSharedFfn: true },
    { swaHeadDim: 32, globalKvHeads: 1, swaPattern: 2 },
    { experts: 4, expertFfn: 128 },
    { swaPattern: 6 },
    { swaPattern: 2, layers: 6, kEqV: true, perLayerEmbd: 32, experts: 4, sharedKvLayers: 2 }
  ],
  qwen3moe: [{ experts: 4, expertFfn: 128 }],
  glm4moe: [{ sharedExperts: 2, denseBlocks: 0 }, { denseBlocks: 3 }, { nextnLayers: 2 }],
  mistral3: [{ experts: 4, expertFfn: 128 }],
  "gpt-oss": [{ experts: 4, expertFfn: 128 }],
  deepseek2: [{ qLoraRank: 0 }, { kvLoraRank: 32, ropeDim: 16, denseBlocks: 2, sharedExperts: 2 }],
  qwen35: [{ fullAttentionInterval: 2, ssmHeads: 8 }, { nextnLayers: 1 }],
  qwen35moe: [{ sharedExperts: 2, nextnLayers: 1 }]
}

/** The file the engine sees: the written metadata and tensor table (no data). */
const fileOf = (o: SyntheticModelOptions): GgufFile => {
  const spec = syntheticModelSpec(o)
  const tensors: ReadonlyArray<GgufTensorInfo> = spec.tensors.map((t) => ({
    name: t.name,
    type: t.type,
    dims: t.dims,
    offset: 0,
    byteSize: 0
  }))
  return {
    path: o.path,
    version: 3,
    alignment: 32,
    dataOffset: 0,
    fileSize: 0,
    metadata: new Map(spec.metadata.map(([k, v]) => [k, v.value])),
    metadataTypes: new Map(
      spec.metadata.map(([k, v]) => [
        k,
        v.itemType === undefined ? { type: v.type } : { type: v.type, itemType: v.itemType }
      ])
    ),
    tensors,
    tensorsByName: new Map(tensors.map((t) => [t.name, t]))
  }
}

/** Every tensor the engine declares for the whole model, by full name. */
const declaredTensors = (file: GgufFile) => {
  const { arch, hp } = Effect.runSync(readModelHParams(file))
  const model = (name: string, dims: ReadonlyArray<number>, kind: TensorSpec["kind"], required: boolean) => ({
    name,
    dims,
    kind,
    required
  })
  const all: Array<TensorSpec> = [
    model("token_embd.weight", [hp.nEmbd, hp.nVocab], "matrix", true),
    model("output_norm.weight", [hp.nEmbd], "vector", true),
    // absent: token_embd is the output head too
    model("output.weight", [hp.nEmbd, hp.nVocab], "matrix", false),
    ...(arch.sharedTensors?.(hp) ?? []),
    ...(arch.inputTensors?.(hp) ?? []),
    ...(arch.outputTensors?.(hp) ?? [])
  ]
  for (let il = 0; il < hp.nLayer; il++)
    for (const s of arch.blockTensors(hp, il)) all.push({ ...s, name: `blk.${il}.${s.name}` })
  return { hp, declared: new Map(all.map((s) => [s.name, s])) }
}

/** The file's tensors the engine does not load, by design: MTP blocks, gemma4's shared-KV blocks' own K/V. */
const notLoaded = (name: string, hp: ReturnType<typeof declaredTensors>["hp"]): boolean => {
  const m = /^blk\.(\d+)\.(.+)$/.exec(name)
  if (m === null) return false
  const il = Number(m[1])
  if (il >= hp.nLayer) return true
  const shared = hp.kvShare !== undefined && hp.kvShare.sources[il] !== il
  return shared && /^attn_(k|v)\.weight$|^attn_k_norm\.weight$/.test(m[2]!)
}

describe("synthetic files hold the tensors their architecture's engine module declares", () => {
  for (const arch of syntheticArchs) {
    for (const v of [{}, ...(variants[arch] ?? [])]) {
      const o = { ...base(arch), ...v }
      it(`${arch} ${JSON.stringify(v)}`, () => {
        expect(validateSyntheticModel(o)).toBeUndefined()
        const file = fileOf(o)
        const { declared, hp } = declaredTensors(file)
        const problems: Array<string> = []
        for (const s of declared.values()) {
          if (s.required && !file.tensorsByName.has(s.name)) problems.push(`${s.name}: required, missing`)
        }
        for (const t of file.tensors) {
          const s = declared.get(t.name)
          if (s === undefined) {
            if (!notLoaded(t.name, hp)) problems.push(`${t.name}: not declared`)
            continue
          }
          if (t.dims.join("x") !== s.dims.join("x"))
            problems.push(`${t.name}: [${t.dims.join(", ")}], declared [${s.dims.join(", ")}]`)
          if (s.kind === "vector" && t.type !== GgmlType.F32) problems.push(`${t.name}: a vector stored as ${t.type}`)
        }
        const mtp = new Set(file.tensors.flatMap((t) => /^blk\.(\d+)\./.exec(t.name)?.[1] ?? []).map(Number))
        expect([...mtp].filter((il) => il >= hp.nLayer).length).toBe(o.nextnLayers ?? 0)
        expect(problems).toEqual([])
      })
    }
  }
})
