/**
 * Mixture-of-experts feed-forward over the toolkit: hyperparameters read and checked from the GGUF, the tensors of a
 * routed block, and the graph of llama.cpp's build_moe_ffn (src/llama-graph.cpp) op for op:
 *
 *   logits = gate_inp x (+ gate_inp_b)         [n_expert, n]
 *   probs  = softmax(logits) | sigmoid(logits) | logits (softmaxWeight)
 *   chosen = top-k(probs + exp_probs_b)        I32 [k, n] (the bias only chooses; the weights stay unbiased)
 *   w      = probs[chosen]                     [1, k, n], then softmax (softmaxWeight), / sum (norm), * scale
 *   out    = sum_i w_i * down_i(silu(gate_i x) * up_i x)   (ggml_mul_mat_id over the stacked experts; gpt-oss adds
 *            each expert's biases with ggml_add_id and takes swiglu_oai for silu(gate) * up, gemma4 GELU)
 *   (+ shared experts: a dense SwiGLU over ffn_*_shexp added to the routed sum; qwen35moe's first times
 *    sigmoid(ffn_gate_inp_shexp x), one gate per token)
 *
 * The expert products are ggml_mul_mat_id, never Toolkit.linear's few-row route: on the CPU, mul_mat_id runs the
 * one-row vec_dot kernel for every (row, expert) pair whatever the batch, so a row's routed output has the same bits
 * in a batch as alone; each row routes on its own logits.
 */
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../domain/gguf.js"
import { getGgml, GgmlType, type Ptr } from "../ggml/Bindings.js"
import { getNumberArray, getOptional, getU32 } from "../gguf/GgufReader.js"
import type { HParams } from "./HParams.js"
import { invalidMetadata } from "./MetadataErrors.js"
import type { ExpertGating, MoeParams } from "./MoeParams.js"
import { GraphOpError } from "./OpChecks.js"
import type { BlockWeights, TensorSpec, Toolkit } from "./Toolkit.js"

/** llama.cpp's LLAMA_MAX_EXPERTS: its loader asserts (aborts) above it. */
export const MAX_EXPERTS = 1024

/** What an architecture fixes (or reads from its own keys) beside the common MoE keys. */
export interface MoeArchOptions {
  readonly gating: ExpertGating
  readonly normWeights: boolean
  readonly weightsScale?: number
  /** Shared experts (their feed-forward length is expert_feed_forward_length times this); default 0. */
  readonly nExpertShared?: number
  /** The shared expert's feed-forward length when the architecture reads it itself (qwen35moe); wins over nExpertShared. */
  readonly nFfShared?: number
  /** The shared expert's output gated per token by sigmoid(ffn_gate_inp_shexp x) (qwen35moe); default false. */
  readonly sharedGate?: boolean
  readonly nLeadingDense?: number
  /**
   * The experts' feed-forward length when the architecture fixes it (mistral3: feed_forward_length);
   * `expert_feed_forward_length` is then not read.
   */
  readonly nFfExp?: number
  /**
   * The architecture reads a fused `ffn_gate_up_exps` in place of ffn_gate_exps and ffn_up_exps (llama.cpp's
   * create_tensor_gate_up_exps: deepseek2, qwen35moe and gemma4 among swactor's architectures); default false.
   */
  readonly fusedGateUp?: boolean
}

/** One positive integer per model, or per layer when stored as an array (all equal: swactor has one value). */
const uniformCount = (file: GgufFile, key: string): Effect.Effect<number | undefined, ModelLoadError> =>
  Effect.gen(function* () {
    if (!file.metadata.has(key)) return undefined
    let n: number
    if (Array.isArray(file.metadata.get(key))) {
      const arr = yield* getNumberArray(file, key)
      const first = arr[0]
      if (first === undefined || arr.some((x) => x !== first)) {
        return yield* Effect.fail(invalidMetadata(file, key, "varies per layer, which swactor does not support"))
      }
      n = first
    } else {
      n = yield* getU32(file, key)
    }
    if (!Number.isSafeInteger(n) || n <= 0) return yield* Effect.fail(invalidMetadata(file, key, `= ${n} must be > 0`))
    return n
  })

/** Routed blocks' stacked expert tensors (short names); their last dim counts the experts. */
const EXPERT_TENSORS = [
  "ffn_gate_exps.weight",
  "ffn_up_exps.weight",
  "ffn_gate_up_exps.weight",
  "ffn_down_exps.weight"
] as const

const FUSED = "ffn_gate_up_exps.weight"

/**
 * Whether the routed blocks hold gate and up fused (`ffn_gate_up_exps`): all of them or none, and only where the
 * architecture reads it; a file that mixes them, or fuses them for an architecture whose llama.cpp loader does not,
 * is refused naming the tensor.
 */
const readFusedGateUp = (
  file: GgufFile,
  arch: string,
  blocks: ReadonlyArray<number>,
  allowed: boolean
): Effect.Effect<boolean, ModelLoadError> => {
  const fused = blocks.filter((il) => file.tensorsByName.has(`blk.${il}.${FUSED}`))
  if (fused.length === 0) return Effect.succeed(false)
  const first = `blk.${fused[0]}.${FUSED}`
  if (!allowed) {
    return Effect.fail(
      new ModelLoadError({
        path: file.path,
        reason: "InvalidMetadata",
        message: `tensor "${first}": fused gate/up experts are not read for ${arch} (llama.cpp reads them for deepseek2, qwen35moe and gemma4); convert without --fuse-gate-up-exps`
      })
    )
  }
  const apart = blocks.find((il) => !file.tensorsByName.has(`blk.${il}.${FUSED}`))
  if (apart !== undefined) {
    return Effect.fail(
      new ModelLoadError({
        path: file.path,
        reason: "MissingTensor",
        message: `tensor "blk.${apart}.${FUSED}" is missing: "${first}" fuses gate/up experts, so every routed block must`
      })
    )
  }
  return Effect.succeed(true)
}

const refuseKey = (file: GgufFile, key: string, message: string) => Effect.fail(invalidMetadata(file, key, message))

/** expert_count (1..1024) and expert_used_count (1..expert_count). */
const readExpertCounts = (file: GgufFile, countKey: string, usedKey: string) =>
  Effect.gen(function* () {
    const nExpert = yield* uniformCount(file, countKey)
    if (nExpert === undefined) return yield* refuseKey(file, countKey, "is missing")
    if (nExpert > MAX_EXPERTS) {
      return yield* refuseKey(file, countKey, `= ${nExpert} is above ${MAX_EXPERTS}`)
    }
    const nExpertUsed = yield* uniformCount(file, usedKey)
    if (nExpertUsed === undefined) return yield* refuseKey(file, usedKey, "is missing")
    if (nExpertUsed > nExpert) {
      return yield* refuseKey(file, usedKey, `= ${nExpertUsed} is more than "${countKey}" = ${nExpert}`)
    }
    return { nExpert, nExpertUsed }
  })

/** Group-limited routing: llama.cpp's loader asserts (aborts) on what is refused here. */
const readExpertGroups = (file: GgufFile, k: (s: string) => string, countKey: string, nExpert: number) =>
  Effect.gen(function* () {
    const groupsKey = k("expert_group_count")
    const groupUsedKey = k("expert_group_used_count")
    const nExpertGroups = (yield* getOptional(file, groupsKey, getU32)) ?? 0
    const nGroupUsed = (yield* getOptional(file, groupUsedKey, getU32)) ?? 0
    if (nExpertGroups >= nExpert) {
      return yield* refuseKey(file, groupsKey, `= ${nExpertGroups} must be below "${countKey}" = ${nExpert}`)
    }
    if (nExpertGroups > 1) {
      if (nExpert % nExpertGroups !== 0) {
        return yield* refuseKey(file, countKey, `= ${nExpert} is not a multiple of "${groupsKey}" = ${nExpertGroups}`)
      }
      if (nExpert / nExpertGroups < 2) {
        return yield* refuseKey(file, groupsKey, `= ${nExpertGroups}: groups of fewer than 2 experts cannot be scored`)
      }
      if (nGroupUsed === 0 || nGroupUsed >= nExpertGroups) {
        return yield* refuseKey(
          file,
          groupUsedKey,
          `= ${nGroupUsed} must be at least 1 and below "${groupsKey}" = ${nExpertGroups}`
        )
      }
    }
    return { nExpertGroups, nGroupUsed }
  })

/**
 * expert_count must agree with the routed blocks' tensors (the loader checks shapes too; this names the key with the
 * tensor).
 */
const checkExpertTensors = (
  file: GgufFile,
  countKey: string,
  nExpert: number,
  firstRouted: number,
  nLayer: number
): Effect.Effect<void, ModelLoadError> => {
  for (let il = firstRouted; il < nLayer; il++) {
    const counted: Array<readonly [string, number | undefined]> = [
      [`blk.${il}.ffn_gate_inp.weight`, file.tensorsByName.get(`blk.${il}.ffn_gate_inp.weight`)?.dims[1]],
      ...EXPERT_TENSORS.map(
        (s) =>
          [
            `blk.${il}.${s}`,
            file.tensorsByName.get(`blk.${il}.${s}`)?.dims[2] ??
              (file.tensorsByName.has(`blk.${il}.${s}`) ? 1 : undefined)
          ] as const
      )
    ]
    for (const [name, n] of counted) {
      if (n !== undefined && n !== nExpert) {
        const dims = file.tensorsByName.get(name)!.dims
        return Effect.fail(
          new ModelLoadError({
            path: file.path,
            reason: "TensorShapeMismatch",
            message: `tensor "${name}" [${dims.join(", ")}] holds ${n} experts, but metadata "${countKey}" = ${nExpert}`
          })
        )
      }
    }
  }
  return Effect.void
}

/**
 * Reads and checks the MoE hyperparameters: expert_count (1..1024), expert_used_count (1..expert_count), the expert
 * feed-forward length; then every routed block's ffn_gate_inp / ffn_*_exps tensors must count expert_count experts.
 * Errors are ModelLoadError naming the key, and the tensor when a tensor disagrees.
 */
export const readMoeParams = (
  file: GgufFile,
  hp: HParams,
  options: MoeArchOptions
): Effect.Effect<MoeParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const countKey = k("expert_count")
    const { nExpert, nExpertUsed } = yield* readExpertCounts(file, countKey, k("expert_used_count"))
    const { nExpertGroups, nGroupUsed } = yield* readExpertGroups(file, k, countKey, nExpert)
    const ffExp = options.nFfExp ?? (yield* uniformCount(file, k("expert_feed_forward_length")))
    const nFfExp = ffExp ?? Math.floor(hp.nFf / nExpertUsed)
    if (nFfExp <= 0) {
      return yield* refuseKey(
        file,
        k("expert_feed_forward_length"),
        `is missing and feed_forward_length / expert_used_count = ${nFfExp}`
      )
    }
    const nLeadingDense = options.nLeadingDense ?? 0
    if (nLeadingDense > hp.nLayer) {
      return yield* refuseKey(
        file,
        k("leading_dense_block_count"),
        `= ${nLeadingDense} is more than the ${hp.nLayer} blocks`
      )
    }
    yield* checkExpertTensors(file, countKey, nExpert, nLeadingDense, hp.nLayer)
    const routed = Array.from({ length: hp.nLayer - nLeadingDense }, (_, i) => nLeadingDense + i)
    const fusedGateUp = yield* readFusedGateUp(file, hp.arch, routed, options.fusedGateUp === true)
    const weightsScale = options.weightsScale ?? 0
    if (!Number.isFinite(weightsScale) || weightsScale < 0) {
      return yield* refuseKey(file, k("expert_weights_scale"), `= ${weightsScale} must be >= 0`)
    }
    return {
      nExpert,
      nExpertUsed,
      nFfExp,
      gating: options.gating,
      normWeights: options.normWeights,
      weightsScale,
      nFfShared: options.nFfShared ?? nFfExp * (options.nExpertShared ?? 0),
      sharedGate: options.sharedGate === true,
      nLeadingDense,
      nExpertGroups,
      nGroupUsed,
      fusedGateUp
    }
  })

/** The tensors of a routed block's feed-forward (short names). */
export const moeBlockSpecs = (hp: HParams, moe: MoeParams): ReadonlyArray<TensorSpec> => {
  const { nExpert: e, nFfExp: f } = moe
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  const specs: Array<TensorSpec> = [
    m("ffn_gate_inp.weight", [hp.nEmbd, e]),
    ...(moe.fusedGateUp
      ? [{ ...m(FUSED, [hp.nEmbd, 2 * f, e]), product: "mul_mat_id" as const }]
      : [
          { ...m("ffn_gate_exps.weight", [hp.nEmbd, f, e]), product: "mul_mat_id" as const },
          { ...m("ffn_up_exps.weight", [hp.nEmbd, f, e]), product: "mul_mat_id" as const }
        ]),
    { ...m("ffn_down_exps.weight", [f, hp.nEmbd, e]), product: "mul_mat_id" }
  ]
  if (moe.nFfShared > 0) {
    specs.push(
      m("ffn_gate_shexp.weight", [hp.nEmbd, moe.nFfShared]),
      m("ffn_up_shexp.weight", [hp.nEmbd, moe.nFfShared]),
      m("ffn_down_shexp.weight", [moe.nFfShared, hp.nEmbd])
    )
    if (moe.sharedGate) specs.push(m("ffn_gate_inp_shexp.weight", [hp.nEmbd]))
  }
  return specs
}

/** The MoE parameters an MoE architecture's readParams set (internal error when absent). */
export const moeOf = (hp: HParams): MoeParams => {
  if (hp.moe === undefined) throw new Error(`internal: ${hp.arch} has no MoE hyperparameters`)
  return hp.moe
}

/**
 * llama.cpp's group-limited selection: scores [n_expert, n] -> the same scores with every expert outside the
 * `nGroupUsed` best groups (a group's score: the sum of its two best) set to -inf. Shapes were checked when the
 * hyperparameters were read (groups divide the experts, at least 2 per group, 1 <= used < groups).
 */
const groupLimited = (t: Toolkit, scores: Ptr, moe: MoeParams, n: number): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const groups = moe.nExpertGroups
  const per = moe.nExpert / groups
  const byGroup = g.ggml_reshape_3d(ctx, scores, per, groups, n) // [per, groups, n]
  const best2 = g.ggml_argsort_top_k(ctx, byGroup, 2) // I32 [2, groups, n]
  let groupScores = g.ggml_get_rows(ctx, g.ggml_reshape_4d(ctx, byGroup, 1, per, groups, n), best2) // [1, 2, groups, n]
  groupScores = g.ggml_sum_rows(ctx, g.ggml_reshape_3d(ctx, groupScores, 2, groups, n)) // [1, groups, n]
  groupScores = g.ggml_reshape_2d(ctx, groupScores, groups, n)
  const chosenGroups = g.ggml_argsort_top_k(ctx, groupScores, moe.nGroupUsed) // I32 [used, n]
  const kept = g.ggml_get_rows(ctx, byGroup, chosenGroups) // [per, used, n]
  const masked = g.ggml_set_rows(ctx, g.ggml_fill(ctx, byGroup, -Infinity), kept, chosenGroups) // [per, groups, n]
  return g.ggml_reshape_2d(ctx, masked, moe.nExpert, n)
}

/** F16's smallest normal number: llama.cpp clamps the weights' sum to it before dividing. */
const MIN_WEIGHT_SUM = 6.103515625e-5

/** llama.cpp's threshold under which a SwiGLU clamp is none (build_moe_ffn, build_ffn). */
const CLAMP_EPS = 1e-6

/** gpt-oss's swiglu_oai constants (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE). */
const SWIGLU_OAI_ALPHA = 1.702
const SWIGLU_OAI_LIMIT = 7

/**
 * What an architecture changes in build_moe_ffn's graph (gemma4: its own router logits, GELU experts, scales;
 * gpt-oss: biases and swiglu_oai).
 */
export interface MoeFfnHooks {
  /** Router logits [n_expert, n] the architecture computed itself (llama.cpp's probs_in); default gate_inp x. */
  readonly logits?: Ptr
  /**
   * The experts' gated activation: SwiGLU (LLM_FFN_SILU, default), GELU (LLM_FFN_GELU, ggml_geglu_split) or
   * gpt-oss's clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE, ggml_swiglu_oai with alpha 1.702 and limit 7).
   */
  readonly activation?: "silu" | "gelu" | "swigluOai"
  /** Kimi K3's situ activation of the experts (LLM_FFN_SITU, `situ`); wins over `activation`. */
  readonly situ?: SituBetas
  /** Per-expert scale F32 [n_expert] on each chosen expert's down output (llama.cpp's down_exps_s); default none. */
  readonly downScale?: Ptr | null
  /**
   * The router and the experts have biases (gpt-oss): `ffn_gate_inp.bias` added to the logits, and
   * `ffn_{up,gate,down}_exps.bias`, F32 [rows, n_expert], added to each chosen expert's product (ggml_add_id); default
   * none. Not with fused gate/up experts.
   */
  readonly biases?: boolean
  /** The experts each row goes to, I32 [k, n], chosen by the architecture (deepseek4's hash-routed blocks); default top-k. */
  readonly chosen?: Ptr
  /**
   * DeepSeek-V4's clamped SwiGLU (ggml_swiglu_clamp) of the routed and the shared experts with these limits (0: the plain
   * SwiGLU); default none.
   */
  readonly swigluClamp?: { readonly experts: number; readonly shared: number }
}

/** A graph-time shape check: GraphOpError naming the op and its operands. */
const check = (ok: boolean, name: string, why: string, ...ts: ReadonlyArray<Ptr>) => {
  if (!ok) {
    const shape = getGgml().tensorShape
    const operands = ts.map((p) => `[${shape(p).ne.join(", ")}] (type ${shape(p).type})`).join(", ")
    throw new GraphOpError(`${name}: ${why} (operands ${operands})`)
  }
}

/**
 * build_moe_ffn's routing over x [n_embd, n]: the router logits, the gating, the expert choice (`probsBias` only
 * chooses) and the chosen experts' weights [1, k, n] (softmax over the chosen ones for softmaxWeight, normalised,
 * scaled), expanded into the graph.
 */
const route = (
  t: Toolkit,
  w: BlockWeights,
  x: Ptr,
  moe: MoeParams,
  probsBias: Ptr | null,
  hooks: MoeFfnHooks
): { readonly chosen: Ptr; readonly weights: Ptr } => {
  const g = t.g
  const ctx = t.ctx
  const shape = getGgml().tensorShape
  const { nExpert, nExpertUsed: k } = moe
  const n = shape(x).ne[1]!
  const routerBias = hooks.biases === true ? w.get("ffn_gate_inp.bias") : null
  const logits = hooks.logits ?? t.linear(w.get("ffn_gate_inp.weight"), x, routerBias) // [n_expert, n]
  check(shape(logits).ne[0] === nExpert, "moeFfn", `router logits must count ${nExpert} experts`, logits)
  const probs =
    moe.gating === "softmax"
      ? g.ggml_soft_max(ctx, logits)
      : moe.gating === "sigmoid"
        ? g.ggml_sigmoid(ctx, logits)
        : moe.gating === "sqrtSoftplus"
          ? g.ggml_sqrt(ctx, g.ggml_softplus(ctx, logits))
          : logits // softmaxWeight: the softmax comes after the choice
  let selection = probs
  if (probsBias !== null) {
    // ggml_add's own check (OpChecks) refuses a bias that does not repeat to [n_expert, n]
    selection = g.ggml_add(ctx, probs, probsBias)
  }
  if (moe.nExpertGroups > 1) selection = groupLimited(t, selection, moe, n)
  check(shape(selection).ne[0]! >= k, "ggml_argsort_top_k", `fewer than ${k} values per row`, selection)
  const chosen = hooks.chosen ?? g.ggml_argsort_top_k(ctx, selection, k) // I32 [k, n]

  let weights = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, probs, 1, nExpert, n), chosen) // [1, k, n]
  if (moe.gating === "softmaxWeight") {
    weights = g.ggml_reshape_3d(ctx, g.ggml_soft_max(ctx, g.ggml_reshape_2d(ctx, weights, k, n)), 1, k, n)
  }
  if (moe.normWeights) {
    const w2 = g.ggml_reshape_2d(ctx, weights, k, n)
    const sum = g.ggml_clamp(ctx, g.ggml_sum_rows(ctx, w2), MIN_WEIGHT_SUM, Infinity) // [1, n]
    weights = g.ggml_reshape_3d(ctx, g.ggml_div(ctx, w2, sum), 1, k, n)
  }
  if (moe.weightsScale !== 0 && moe.weightsScale !== 1) weights = g.ggml_scale(ctx, weights, moe.weightsScale)
  g.ggml_build_forward_expand(t.graph, weights)
  return { chosen, weights }
}

/**
 * The chosen experts over cur [n_embd, 1, n]: up and gate (fused or apart, with their biases), the activation, down
 * (with its bias and per-expert scale): [n_embd, k, n], not yet weighted.
 */
const chosenExperts = (t: Toolkit, w: BlockWeights, cur: Ptr, chosen: Ptr, moe: MoeParams, hooks: MoeFfnHooks): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const shape = getGgml().tensorShape
  const { nExpert } = moe
  const biases = hooks.biases === true
  const mulMatId = (name: string, input: Ptr) => {
    const a = w.get(`${name}.weight`)
    const [sa, sb, si] = [shape(a), shape(input), shape(chosen)]
    check(
      sa.ne[3] === 1 &&
        sb.ne[3] === 1 &&
        si.type === GgmlType.I32 &&
        si.ne[1] === sb.ne[2] &&
        sa.ne[0] === sb.ne[0] &&
        si.ne[0]! % sb.ne[1]! === 0 &&
        sa.ne[2] === nExpert,
      "ggml_mul_mat_id",
      "the experts, the rows and the expert ids do not match",
      a,
      input,
      chosen
    )
    const product = g.ggml_mul_mat_id(ctx, a, input, chosen)
    if (!biases) return product
    const b = w.get(`${name}.bias`)
    const sbias = shape(b)
    check(
      sbias.type === GgmlType.F32 && sbias.ne[0] === sa.ne[1] && sbias.ne[1] === nExpert,
      "ggml_add_id",
      `${name}.bias must be F32 [rows, ${nExpert}]`,
      a,
      b
    )
    return g.ggml_add_id(ctx, product, b, chosen) // [rows, k, n]
  }
  let up: Ptr
  let gate: Ptr
  if (moe.fusedGateUp) {
    check(!biases, "moeFfn", "fused gate/up experts take no biases", cur)
    // one product for both (llama.cpp's build_moe_ffn with gate_up_exps): [2 n_ff_exp, k, n], gate rows first
    const both = mulMatId("ffn_gate_up_exps", cur)
    const sb = shape(both)
    const f = sb.ne[0]! / 2
    gate = g.ggml_view_3d(ctx, both, f, sb.ne[1]!, sb.ne[2]!, sb.nb[1]!, sb.nb[2]!, 0)
    up = g.ggml_view_3d(ctx, both, f, sb.ne[1]!, sb.ne[2]!, sb.nb[1]!, sb.nb[2]!, f * sb.nb[0]!)
  } else {
    up = mulMatId("ffn_up_exps", cur) // [n_ff_exp, k, n]
    gate = mulMatId("ffn_gate_exps", cur)
  }
  const clamp = hooks.swigluClamp?.experts ?? 0
  const act =
    hooks.situ !== undefined
      ? situ(t, gate, up, hooks.situ)
      : clamp > CLAMP_EPS
        ? g.ggml_swiglu_clamp(ctx, gate, up, clamp)
        : hooks.activation === "gelu"
          ? g.ggml_geglu_split(ctx, gate, up)
          : hooks.activation === "swigluOai"
            ? g.ggml_swiglu_oai(ctx, gate, up, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
            : g.ggml_swiglu_split(ctx, gate, up)
  let experts = mulMatId("ffn_down_exps", act) // [n_embd, k, n]
  const downScale = hooks.downScale ?? null
  if (downScale !== null) {
    // llama.cpp's build_lora_mm_id: each chosen expert's output times its own scale
    check(shape(downScale).ne[0] === nExpert, "moeFfn", `the per-expert scale must hold ${nExpert} values`, downScale)
    const n = shape(cur).ne[2]!
    const all = g.ggml_repeat_4d(ctx, g.ggml_reshape_3d(ctx, downScale, 1, nExpert, 1), 1, nExpert, n, 1)
    experts = g.ggml_mul(ctx, experts, g.ggml_get_rows(ctx, all, chosen))
  }
  return experts
}

/**
 * The routed feed-forward of one block over x [n_embd, n] (already normed): llama.cpp's build_moe_ffn with the
 * SwiGLU experts (LLM_FFN_SILU) unless `hooks` say otherwise. `probsBias` is exp_probs_b (selection only), shared
 * experts when `moe.nFfShared`.
 */
export const moeFfn = (
  t: Toolkit,
  w: BlockWeights,
  x: Ptr,
  moe: MoeParams,
  probsBias: Ptr | null = null,
  hooks: MoeFfnHooks = {}
): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const { nEmbd } = t.hp
  const sx = getGgml().tensorShape(x)
  check(sx.ne[0] === nEmbd && sx.ne[2] === 1 && sx.ne[3] === 1, "moeFfn", `input must be [${nEmbd}, n]`, x)

  let out = routedExperts(t, w, x, moe, probsBias, hooks)

  if (moe.nFfShared > 0) {
    const shUp = t.linear(w.get("ffn_up_shexp.weight"), x)
    const shGate = t.linear(w.get("ffn_gate_shexp.weight"), x)
    const clamp = hooks.swigluClamp?.shared ?? 0
    const act =
      clamp > CLAMP_EPS ? g.ggml_swiglu_clamp(ctx, shGate, shUp, clamp) : g.ggml_swiglu_split(ctx, shGate, shUp)
    let shared = t.linear(w.get("ffn_down_shexp.weight"), act)
    // [1, n]: one gate per token, broadcast over the row
    if (moe.sharedGate)
      shared = g.ggml_mul(ctx, shared, g.ggml_sigmoid(ctx, t.linear(w.get("ffn_gate_inp_shexp.weight"), x)))
    out = g.ggml_add(ctx, out, shared)
  }
  return out
}

/**
 * The routed experts alone over x [width, n] (nEmbd, or Kimi K3's latent width with the router's logits in `hooks`):
 * the routing, the chosen experts weighted and summed; [width, n].
 */
export const routedExperts = (
  t: Toolkit,
  w: BlockWeights,
  x: Ptr,
  moe: MoeParams,
  probsBias: Ptr | null,
  hooks: MoeFfnHooks
): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const [width, n] = getGgml().tensorShape(x).ne as [number, number]
  const { chosen, weights } = route(t, w, x, moe, probsBias, hooks)
  const cur = g.ggml_reshape_3d(ctx, x, width, 1, n)
  let experts = chosenExperts(t, w, cur, chosen, moe, hooks)
  experts = g.ggml_mul(ctx, experts, weights)
  g.ggml_build_forward_expand(t.graph, experts)
  return sumExperts(t, experts, width, n, moe.nExpertUsed)
}

/** Kimi K3's situ betas (`activation.situ_beta`, `activation.situ_linear_beta`; the latter 0 or less: off). */
export interface SituBetas {
  readonly beta: number
  readonly linearBeta: number
}

/** situ(gate, up) = beta tanh(gate / beta) sigmoid(gate) x linearBeta tanh(up / linearBeta) (llama.cpp's LLM_FFN_SITU). */
export const situ = (t: Toolkit, gate: Ptr, up: Ptr, b: SituBetas): Ptr => {
  const g = t.g
  const ctx = t.ctx
  // 1.0f / beta in F32, as llama.cpp divides
  const squash = (x: Ptr, beta: number) =>
    g.ggml_scale(ctx, g.ggml_tanh(ctx, g.ggml_scale(ctx, x, Math.fround(1 / Math.fround(beta)))), beta)
  const a = g.ggml_mul(ctx, squash(gate, b.beta), g.ggml_sigmoid(ctx, gate))
  return g.ggml_mul(ctx, a, b.linearBeta > 0 ? squash(up, b.linearBeta) : up)
}

/**
 * The sum over the k chosen experts of `experts` [nEmbd, k, n]: views first, then the adds (llama.cpp's order);
 * [nEmbd, n], contiguous.
 */
export const sumExperts = (t: Toolkit, experts: Ptr, nEmbd: number, n: number, k: number): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const nb = getGgml().tensorShape(experts).nb
  const views: Array<Ptr> = []
  for (let i = 0; i < k; i++) {
    const v = g.ggml_view_2d(ctx, experts, nEmbd, n, nb[2]!, i * nb[1]!)
    g.ggml_build_forward_expand(t.graph, v)
    views.push(v)
  }
  let out: Ptr = views[0]!
  for (let i = 1; i < k; i++) {
    out = g.ggml_add(ctx, out, views[i]!)
    g.ggml_build_forward_expand(t.graph, out)
  }
  return k === 1 ? g.ggml_cont(ctx, out) : out
}
