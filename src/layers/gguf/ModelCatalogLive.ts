/**
 * The `ModelCatalog` service's implementations: `layer` reads each model's GGUF metadata (no tensor data);
 * `layerTest` answers from a table, for tests that plan without a model file.
 */
import { kvLayoutOf, type KvLayout } from "../engine/BlockMemory.js"
import { readModelHParams } from "../engine/StageLayout.js"
import { trunkBlockCount } from "./TrunkBlocks.js"
import { statSync } from "node:fs"
import { basename } from "node:path"
import { Effect, Layer } from "effect"
import { ModelLoadError } from "../../domain/gguf.js"
import type { GgufFile } from "../../domain/gguf.js"
import type { ModelFacts, ModelLayout } from "../../domain/plan.js"
import { ModelCatalog, type ModelCatalogService } from "../../services/ModelCatalog.js"
import * as Gguf from "./GgufReader.js"
import { namedModelFiles } from "./GgufSplit.js"
import { readModelHeader } from "./ModelSource.js"
import { isRemoteModel } from "../../domain/modelName.js"

/** Parsed headers by path, with the file version (device, inode, size, mtime and ctime in ns) they were read from. */
const headers = new Map<string, { readonly version: string; readonly file: GgufFile }>()
const HEADER_CACHE_LIMIT = 16

const versionOf = (path: string): string | undefined => {
  try {
    // every part of a split set counts: a part rewritten is another model
    return namedModelFiles(path)
      .map((p) => {
        const st = statSync(p, { bigint: true })
        return `${st.dev}:${st.ino}:${st.size}:${st.mtimeNs}:${st.ctimeNs}`
      })
      .join("|")
  } catch {
    return undefined
  }
}

/**
 * A GGUF file's header, metadata and tensor table (no tensor data), parsed once per file version in this process:
 * the orchestrator's facts and layout, `swactor plan` and every stage an agent loads from one file share one parse.
 * A file rewritten since (another size, inode or time) is parsed again.
 */
export const readHeader = (path: string): Effect.Effect<GgufFile, ModelLoadError> =>
  Effect.suspend(() => {
    // a hub name or URL: RemoteGguf keeps its own parsed headers, by the model's version
    if (isRemoteModel(path)) return readModelHeader(path)
    const version = versionOf(path)
    const hit = headers.get(path)
    if (version !== undefined && hit !== undefined && hit.version === version) return Effect.succeed(hit.file)
    return Gguf.readGgufFile(path).pipe(
      Effect.tap((file) =>
        Effect.sync(() => {
          if (version === undefined || versionOf(path) !== version) return // changed while read: keep no copy
          headers.delete(path)
          if (headers.size >= HEADER_CACHE_LIMIT) headers.delete(headers.keys().next().value!)
          headers.set(path, { version, file })
        })
      )
    )
  })

/**
 * The facts planning needs, from a GGUF file's metadata: `block_count` (less MTP blocks), `embedding_length` and `context_length` of
 * its architecture, and the EOS token (2 when absent). Activations travel as f32, so the dtype is Float, 4 bytes.
 */
export const readModelFacts = (path: string): Effect.Effect<ModelFacts, ModelLoadError> =>
  Effect.gen(function* () {
    const file = yield* readHeader(path)
    const arch = yield* Gguf.getArchitecture(file)
    // MTP blocks (`nextn_predict_layers`) trail the trunk and are never placed: TrunkBlocks.ts
    const numLayers = yield* trunkBlockCount(file, arch)
    // deepseek4's hyper-connections: the residual stream between stages is `hyper_connection.count` streams wide;
    // Kimi K3's attention residuals: the stream plus the checkpoints banked before the boundary, the most before the
    // last block (PerLayerInputs.activationWidth), so that every boundary's frame fits
    const streams = (yield* Gguf.getOptional(file, `${arch}.hyper_connection.count`, Gguf.getU32)) ?? 1
    const resBlockSize = (yield* Gguf.getOptional(file, `${arch}.attn_res.block_size`, Gguf.getU32)) ?? 0
    const checkpoints = resBlockSize > 0 ? Math.ceil((numLayers - 1) / resBlockSize) : 0
    const hiddenDim = (yield* Gguf.getU32(file, `${arch}.embedding_length`)) * (streams + checkpoints)
    const maxSeqLen = yield* Gguf.getU32(file, `${arch}.context_length`)
    const eos = yield* Gguf.getOptional(file, "tokenizer.ggml.eos_token_id", Gguf.getU32)
    return {
      modelId: basename(path),
      ggufSource: { _tag: "LocalPath", path },
      numLayers,
      hiddenDim,
      dtypeFamily: "Float",
      dtypeWidthBytes: 4,
      maxSeqLen,
      eosTokenId: eos ?? 2,
      tokenizer: { _tag: "EmbeddedInGguf" }
    } satisfies ModelFacts
  })

/** A mixture of experts' routing figures: experts stored per MoE block, and experts each token is routed to. */
interface ExpertCounts {
  readonly count: number
  readonly used: number
}

/**
 * Stacked expert tensors (`blk.N.ffn_gate_exps.weight` [n_embd, n_ff_exp, n_expert], `ffn_up_exps`, `ffn_down_exps`,
 * fused `ffn_gate_up_exps`, their biases): the last dimension counts the experts. Shared experts (`_shexp`) and the
 * router (`ffn_gate_inp`) are read whole by every token.
 */
const isStackedExperts = (name: string) => /^blk\.\d+\.ffn_[a-z_]*_exps\./.test(name)

/**
 * The expert counts of a file with stacked expert tensors (undefined for a dense file), validated against those
 * tensors: `<arch>.expert_count` and `<arch>.expert_used_count` present, 1 <= used <= count, and every stacked expert
 * tensor's and router's last dimension equal to the count. Each problem is a `ModelLoadError` naming the key or
 * tensor.
 */
const expertCountsOf = (file: GgufFile, arch: string): Effect.Effect<ExpertCounts | undefined, ModelLoadError> =>
  Effect.gen(function* () {
    const stacked = file.tensors.filter((t) => isStackedExperts(t.name))
    if (stacked.length === 0) return undefined
    const first = stacked[0]!.name
    const key = (name: string) =>
      Gguf.hasKey(file, name)
        ? Gguf.getU32(file, name)
        : Effect.fail(
            new ModelLoadError({
              path: file.path,
              reason: "InvalidMetadata",
              message: `metadata key "${name}" is missing: the file has stacked expert tensors (${first})`
            })
          )
    const count = yield* key(`${arch}.expert_count`)
    const used = yield* key(`${arch}.expert_used_count`)
    if (count < 1 || used < 1 || used > count) {
      return yield* new ModelLoadError({
        path: file.path,
        reason: "InvalidMetadata",
        message: `metadata "${arch}.expert_used_count" = ${used} must be between 1 and "${arch}.expert_count" = ${count}`
      })
    }
    const routers = file.tensors.filter((t) => /^blk\.\d+\.ffn_gate_inp\.weight$/.test(t.name))
    for (const tensor of [...stacked, ...routers]) {
      const last = tensor.dims[tensor.dims.length - 1]
      // a per-expert scale (gemma4 26B-A4B's ffn_down_exps.scale) is one value per expert: [count]
      const perExpert = tensor.name.endsWith("_exps.scale") && tensor.dims.length === 1
      if ((tensor.dims.length < 2 && !perExpert) || last !== count) {
        return yield* new ModelLoadError({
          path: file.path,
          reason: "TensorShapeMismatch",
          message:
            `tensor "${tensor.name}" has shape [${tensor.dims.join(", ")}]: its last dimension must be ` +
            `"${arch}.expert_count" = ${count}`
        })
      }
    }
    return { count, used }
  })

/**
 * Per-block sizes from the tensor table: every `blk.N.*` tensor's bytes count for block N; `token_embd` is the input
 * (with gemma4's per-layer tables, which only the first stage loads); `output_norm` + `output` (or `token_embd` again
 * when the output is tied to it) the output head. Bytes read per token (active): every tensor whole, except stacked
 * expert tensors, of which a token reads `used / count` (`experts`, validated by `expertCountsOf`). What each block
 * keeps per sequence (KV rows, sliding windows, DeltaNet states, shared caches) is the engine's own plan of the model's
 * hyperparameters (engine/BlockMemory.ts), so placement and admission size exactly what a stage allocates.
 */
const layoutOfFile = (
  file: GgufFile,
  numLayers: number,
  hiddenDim: number,
  experts: ExpertCounts | undefined,
  memory: KvLayout
): ModelLayout => {
  const blockBytes = Array<number>(numLayers).fill(0)
  const activeBlockBytes = Array<number>(numLayers).fill(0)
  for (const tensor of file.tensors) {
    const match = /^blk\.(\d+)\./.exec(tensor.name)
    if (match === null) continue
    const block = Number(match[1])
    if (block >= numLayers) continue
    blockBytes[block]! += tensor.byteSize
    activeBlockBytes[block]! +=
      experts !== undefined && isStackedExperts(tensor.name)
        ? (tensor.byteSize / experts.count) * experts.used
        : tensor.byteSize
  }
  const bytes = (name: string) => file.tensorsByName.get(name)?.byteSize ?? 0
  const output = file.tensorsByName.has("output.weight") ? bytes("output.weight") : bytes("token_embd.weight")
  // gemma4 E2B/E4B's per-layer tables (per_layer_token_embd, per_layer_model_proj, per_layer_proj_norm)
  const perLayerTables = file.tensors.filter((t) => t.name.startsWith("per_layer_")).reduce((s, t) => s + t.byteSize, 0)
  return {
    blockBytes,
    activeBlockBytes,
    ...memory,
    inputBytes: bytes("token_embd.weight") + perLayerTables,
    outputBytes: bytes("output_norm.weight") + output,
    hiddenDim
  }
}

export const readModelLayout = (path: string): Effect.Effect<ModelLayout, ModelLoadError> =>
  Effect.gen(function* () {
    const file = yield* readHeader(path)
    const facts = yield* readModelFacts(path)
    const arch = yield* Gguf.getArchitecture(file)
    const experts = yield* expertCountsOf(file, arch)
    const { hp } = yield* readModelHParams(file)
    return layoutOfFile(file, facts.numLayers, facts.hiddenDim, experts, kvLayoutOf(hp, facts.numLayers))
  })

export const make: ModelCatalogService = { facts: readModelFacts, layout: readModelLayout, header: readHeader }

/** Reads GGUF metadata from the file system. */
export const layer: Layer.Layer<ModelCatalog> = Layer.succeed(ModelCatalog, make)

/** Answers from `models` (path → facts); any other path is a `ModelLoadError` (Io). */
export const layerTest = (
  models: ReadonlyMap<string, ModelFacts>,
  layouts: ReadonlyMap<string, ModelLayout> = new Map()
): Layer.Layer<ModelCatalog> =>
  Layer.succeed(ModelCatalog, {
    facts: (path) => {
      const facts = models.get(path)
      return facts !== undefined
        ? Effect.succeed(facts)
        : Effect.fail(new ModelLoadError({ path, reason: "Io", message: `no model at ${path}` }))
    },
    layout: (path) => {
      const layout = layouts.get(path)
      return layout !== undefined
        ? Effect.succeed(layout)
        : Effect.fail(new ModelLoadError({ path, reason: "Io", message: `no model layout for ${path}` }))
    },
    header: (path) =>
      Effect.fail(new ModelLoadError({ path, reason: "Io", message: `no GGUF header in the test catalog: ${path}` }))
  })
