/**
 * What a stage loads, decided and checked in TypeScript before any native call: the architecture, its
 * hyperparameters, and every tensor of the block range (name, shape, type, bytes) against the GGUF table.
 */
import { Effect } from "effect"
import type { StageLoadSpec } from "../../domain/engine.js"
import { GgmlType, ggmlTypeInfo } from "../../domain/ggmlTypes.js"
import {
  type GgufFile,
  type GgufTensorInfo,
  ModelLoadError,
  tensorFilePath,
  tensorFileSize
} from "../../domain/gguf.js"
import { getArchitecture } from "../gguf/GgufReader.js"
import type { ArchModule } from "./Arch.js"
import { type HParams, readHParams } from "./HParams.js"
import { architectures, supportedArchitectures } from "./Registry.js"
import { getGgml } from "../ggml/Bindings.js"
import { cpuComputesWeightType } from "../ggml/CpuTypeSupport.js"
import type { TensorSpec } from "./Toolkit.js"
import { kvShareCut } from "./PerLayerInputs.js"

/** How a weight is used in the graph (decides its buffer type, as llama.cpp does). */
export type WeightUse = "get_rows" | "mul_mat" | "mul_mat_id" | "vector"

const useOf = (s: TensorSpec): WeightUse => (s.kind === "vector" ? "vector" : (s.product ?? "mul_mat"))

export interface PlannedTensor {
  /** Name of the tensor in the stage (usually the GGUF name; `output.weight` for a tied output). */
  readonly name: string
  readonly info: GgufTensorInfo
  readonly use: WeightUse
  /** Which part of the stage it serves: its input tables (first stage), shared by its blocks, a block, the output head. */
  readonly part: "input" | "shared" | "block" | "output"
}

export interface StageLayout {
  readonly file: GgufFile
  readonly arch: ArchModule
  readonly hp: HParams
  readonly spec: StageLoadSpec
  readonly tensors: ReadonlyArray<PlannedTensor>
  /** Sum of the GGUF byte sizes of `tensors`. */
  readonly weightBytes: number
  /** The output projection reuses token_embd (no `output.weight` in the file). */
  readonly tiedOutput: boolean
}

/**
 * Tensor types a matrix may have: those the loaded ggml CPU backend multiplies and gathers, asked of ggml
 * (src/layers/ggml/CpuTypeSupport.ts; cached per process). A GgmlBindingError (no libraries) is BackendUnavailable.
 */
const matrixTypeSupported = (file: GgufFile, type: number): Effect.Effect<boolean, ModelLoadError> =>
  Effect.try({
    try: () => cpuComputesWeightType(getGgml(), type),
    catch: (e) =>
      new ModelLoadError({
        path: file.path,
        reason: "BackendUnavailable",
        message: e instanceof Error ? e.message : String(e)
      })
  })

const fail = (file: GgufFile, reason: ModelLoadError["reason"], message: string) =>
  Effect.fail(new ModelLoadError({ path: file.path, reason, message }))

const sameDims = (a: ReadonlyArray<number>, b: ReadonlyArray<number>) => {
  const strip = (d: ReadonlyArray<number>) => {
    const out = [...d]
    while (out.length > 1 && out[out.length - 1] === 1) out.pop()
    return out
  }
  const x = strip(a)
  const y = strip(b)
  return x.length === y.length && x.every((v, i) => v === y[i])
}

/** Checks one tensor against its spec; undefined when an optional tensor is absent. */
const checkTensor = (
  file: GgufFile,
  fullName: string,
  spec: TensorSpec
): Effect.Effect<GgufTensorInfo | undefined, ModelLoadError> => {
  const info = file.tensorsByName.get(fullName)
  if (info === undefined) {
    return spec.required
      ? fail(file, "MissingTensor", `tensor "${fullName}" is missing (expected [${spec.dims.join(", ")}])`)
      : Effect.succeed(undefined)
  }
  if (!sameDims(info.dims, spec.dims)) {
    return fail(
      file,
      "TensorShapeMismatch",
      `tensor "${fullName}" has shape [${info.dims.join(", ")}], expected [${spec.dims.join(", ")}]`
    )
  }
  const t = ggmlTypeInfo(info.type)
  if (t === undefined) {
    return fail(file, "UnsupportedTensorType", `tensor "${fullName}" has unknown ggml type ${info.type}`)
  }
  if (spec.exactType !== undefined) {
    return info.type === spec.exactType
      ? Effect.succeed(info)
      : fail(
          file,
          "TensorTypeMismatch",
          `tensor "${fullName}" is ${t.name}, expected ${ggmlTypeInfo(spec.exactType)?.name ?? spec.exactType}`
        )
  }
  if (spec.kind === "vector" && info.type !== GgmlType.F32) {
    return fail(file, "TensorTypeMismatch", `tensor "${fullName}" is ${t.name}, expected f32`)
  }
  if (spec.kind === "matrix") {
    if ((info.dims[0] ?? 0) % t.blockSize !== 0) {
      return fail(
        file,
        "TensorShapeMismatch",
        `tensor "${fullName}" row length ${info.dims[0]} is not a multiple of ${t.name}'s block size ${t.blockSize}`
      )
    }
    return Effect.flatMap(matrixTypeSupported(file, info.type), (ok) =>
      ok
        ? Effect.succeed(info)
        : fail(
            file,
            "UnsupportedTensorType",
            `tensor "${fullName}" has type ${t.name}, which the ggml CPU backend cannot multiply or gather`
          )
    )
  }
  return Effect.succeed(info)
}

/** The architecture module of a file, or UnsupportedArchitecture listing the supported ones. */
export const archOf = (file: GgufFile): Effect.Effect<ArchModule, ModelLoadError> =>
  Effect.flatMap(getArchitecture(file), (name) => {
    const arch = architectures.get(name)
    return arch === undefined
      ? fail(
          file,
          "UnsupportedArchitecture",
          `architecture "${name}" is not supported; supported: ${supportedArchitectures().join(", ")}`
        )
      : Effect.succeed(arch)
  })

/**
 * A file's hyperparameters as its architecture module reads and checks them (readHParams, then the module's own): the
 * one source of the model's facts for the engine, and for the catalog's layout (BlockMemory.ts), header only.
 */
export const readModelHParams = (
  file: GgufFile
): Effect.Effect<{ readonly arch: ArchModule; readonly hp: HParams }, ModelLoadError> =>
  Effect.gen(function* () {
    const arch = yield* archOf(file)
    const common = yield* readHParams(file, arch.ropeMode, {
      ownHeadShape: arch.ownHeadShape === true,
      kvHeadsPerBlock: arch.kvHeadsPerBlock === true,
      recurrentKvZero: arch.recurrentKvZero === true,
      ffPerBlock: arch.ffPerBlock === true,
      ffOptional: arch.ffOptional === true
    })
    return { arch, hp: arch.hparams === undefined ? common : yield* arch.hparams(file, common) }
  })

/** The block range: non-empty, inside the model, first and last as the spec says, no shared KV cut apart. */
const checkRange = (file: GgufFile, hp: HParams, spec: StageLoadSpec): Effect.Effect<void, ModelLoadError> => {
  const { layerEndExclusive: end, layerStart: start } = spec
  if (!Number.isInteger(start) || !Number.isInteger(end) || start < 0 || end > hp.nLayer || start >= end) {
    return fail(
      file,
      "InvalidLayerRange",
      `block range [${start}, ${end}) is not a non-empty range inside the model's ${hp.nLayer} blocks`
    )
  }
  if (spec.isFirst !== (start === 0)) {
    return fail(file, "InvalidLayerRange", `isFirst=${spec.isFirst} but the range starts at block ${start}`)
  }
  if (spec.isLast !== (end === hp.nLayer)) {
    return fail(file, "InvalidLayerRange", `isLast=${spec.isLast} but the range ends at block ${end} of ${hp.nLayer}`)
  }
  // a block that reads an earlier block's KV cache runs on the stage that holds that cache (HParams.kvShare)
  const cut = kvShareCut(hp, start, end)
  if (cut !== undefined) return fail(file, "InvalidLayerRange", cut)
  return Effect.void
}

const embdSpecOf = (hp: HParams): TensorSpec => ({
  name: "token_embd.weight",
  dims: [hp.nEmbd, hp.nVocab],
  kind: "matrix",
  required: true
})

/** The first stage's tensors: the token embeddings, and tables looked up by token id and their projections. */
const inputTensors = (file: GgufFile, arch: ArchModule, hp: HParams, out: Array<PlannedTensor>) =>
  Effect.gen(function* () {
    const info = yield* checkTensor(file, "token_embd.weight", embdSpecOf(hp))
    if (info !== undefined) out.push({ name: "token_embd.weight", info, use: "get_rows", part: "input" })
    // first stage only: tables looked up by token id (gemma4's per_layer_token_embd) and their projections
    for (const s of arch.inputTensors?.(hp) ?? []) {
      const info = yield* checkTensor(file, s.name, s)
      if (info !== undefined)
        out.push({
          name: s.name,
          info,
          use: s.name.endsWith("token_embd.weight") ? "get_rows" : useOf(s),
          part: "input"
        })
    }
  })

/** The tensors every stage holds, then each block's of the range. */
const sharedAndBlockTensors = (
  file: GgufFile,
  arch: ArchModule,
  hp: HParams,
  spec: StageLoadSpec,
  out: Array<PlannedTensor>
) =>
  Effect.gen(function* () {
    for (const s of arch.sharedTensors?.(hp) ?? []) {
      const info = yield* checkTensor(file, s.name, s)
      if (info !== undefined) out.push({ name: s.name, info, use: useOf(s), part: "shared" })
    }
    for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) {
      // per block: an architecture may mix block kinds (glm4moe: dense leading blocks, then routed ones)
      for (const s of arch.blockTensors(hp, il)) {
        const name = `blk.${il}.${s.name}`
        const info = yield* checkTensor(file, name, s)
        if (info !== undefined) out.push({ name, info, use: useOf(s), part: "block" })
      }
    }
  })

/** The last stage's tensors: the output norm, the output head (the token embeddings when tied), the architecture's. */
const outputTensors = (file: GgufFile, arch: ArchModule, hp: HParams, out: Array<PlannedTensor>) =>
  Effect.gen(function* () {
    const embdSpec = embdSpecOf(hp)
    let tiedOutput = false
    const norm = yield* checkTensor(file, "output_norm.weight", {
      name: "output_norm.weight",
      dims: [hp.nEmbd],
      kind: "vector",
      required: true
    })
    if (norm !== undefined) out.push({ name: "output_norm.weight", info: norm, use: "vector", part: "output" })
    const output = yield* checkTensor(file, "output.weight", { ...embdSpec, name: "output.weight", required: false })
    if (output !== undefined) {
      out.push({ name: "output.weight", info: output, use: "mul_mat", part: "output" })
    } else {
      tiedOutput = true
      const embd = yield* checkTensor(file, "token_embd.weight", embdSpec)
      if (embd !== undefined) out.push({ name: "output.weight", info: embd, use: "mul_mat", part: "output" })
    }
    for (const s of arch.outputTensors?.(hp) ?? []) {
      const info = yield* checkTensor(file, s.name, s)
      if (info !== undefined) out.push({ name: s.name, info, use: useOf(s), part: "output" })
    }
    return tiedOutput
  })

/** Every planned tensor's data inside its file. */
const checkInFile = (file: GgufFile, out: ReadonlyArray<PlannedTensor>): Effect.Effect<void, ModelLoadError> => {
  for (const t of out) {
    if (t.info.offset + t.info.byteSize > tensorFileSize(file, t.info)) {
      return fail(
        file,
        "OffsetOutOfBounds",
        `tensor "${t.info.name}" data ends past the end of ${t.info.part === undefined ? "the file" : tensorFilePath(file, t.info)}`
      )
    }
  }
  return Effect.void
}

/** Plans (and fully validates) the load of one stage. */
export const layoutStage = (file: GgufFile, spec: StageLoadSpec): Effect.Effect<StageLayout, ModelLoadError> =>
  Effect.gen(function* () {
    const { arch, hp } = yield* readModelHParams(file)
    yield* checkRange(file, hp, spec)
    const out: Array<PlannedTensor> = []
    if (spec.isFirst) yield* inputTensors(file, arch, hp, out)
    yield* sharedAndBlockTensors(file, arch, hp, spec, out)
    const tiedOutput = spec.isLast ? yield* outputTensors(file, arch, hp, out) : false
    yield* checkInFile(file, out)
    const weightBytes = out.reduce((s, t) => s + t.info.byteSize, 0)
    return { file, arch, hp, spec, tensors: out, weightBytes, tiedOutput }
  })
