/**
 * A node agent (`swactor node`): a data listener, the stage host (StageHost.ts) over it, and the authenticated
 * control RPC (AgentControlRpc.ts) that orchestrators provision stages through.
 */
import { Effect, type Scope } from "effect"
import type { EdgeFault, TransportAddress } from "../../domain/frames.js"
import { AgentHello, type AgentUnavailable, DataPlane } from "../../services/AgentLinks.js"
import type { StageExecutor } from "../../services/StageExecutor.js"
import { Settings } from "../config/Settings.js"
import { defaultSliceCacheDir, makeWeightStore } from "../gguf/SliceStore.js"
import { serveControlRpc } from "./AgentControlRpc.js"
import type { BatcherSettings } from "./StageBatcher.js"
import { makeStageHost, type StageHostOptions } from "./StageHost.js"
import type { Backend } from "../../domain/engine.js"

// Existing imports of the stage host through this module (AgentLinksTest.ts, src/index.ts) keep working.
export { makeStageHost }
export type { StageHost } from "./StageHost.js"

export interface NodeAgentOptions {
  /** Control-plane address (host:port). */
  readonly listen: TransportAddress
  /** Data-plane address (default: the control host, an ephemeral port). */
  readonly dataListen?: TransportAddress
  /** Data address to tell orchestrators (default: the bound one; the connection's local address for wildcard binds). */
  readonly dataAdvertise?: TransportAddress
  readonly token: string
  readonly threads: number
  readonly backend: Backend
  /**
   * Stage batcher settings (default: 256 rows per micro-batch, 128 tokens per prompt chunk; `swactor node` passes
   * SWACTOR_BATCH_MAX_ROWS and SWACTOR_PREFILL_CHUNK, config/Settings.ts).
   */
  readonly batch?: BatcherSettings
  /** See StageHostOptions.settleWeights. */
  readonly settleWeights?: StageHostOptions["settleWeights"]
  /** Cap on the free memory reported to orchestrators (bytes). */
  readonly memoryLimitBytes?: number
  /** Engine speed, weight bytes per second: declared (`--speed`) or measured at start. */
  readonly speedBytesPerSecond?: number
  readonly speedSource?: "declared" | "measured"
  /** Where delivered slices live (default `$XDG_CACHE_HOME/swactor/slices`). */
  readonly cacheDir?: string
  /** Never read the orchestrator's model paths: load delivered slices only. */
  readonly slicesOnly?: boolean
  /** Operator-facing lines (received slices, which file a stage loads). */
  readonly log?: (line: string) => void
  /** Set once a speed measured after start is known (capacity reports none until then). */
  readonly laterSpeed?: { current: number | undefined }
  /** See StageHostOptions.stepProbeRows. */
  readonly stepProbeRows?: number
  /** See StageHostOptions.devices. */
  readonly devices?: StageHostOptions["devices"]
}

export interface RunningAgent {
  readonly control: TransportAddress
  readonly data: TransportAddress
}

/** Serves stages until the scope closes: data listener, stage host, authenticated control link. */
export const startNodeAgent = (
  options: NodeAgentOptions
): Effect.Effect<RunningAgent, AgentUnavailable | EdgeFault, Scope.Scope | StageExecutor | DataPlane> =>
  Effect.gen(function* () {
    const dataPlane = yield* DataPlane
    const controlHost = options.listen._tag === "Tcp" ? options.listen.host : "127.0.0.1"
    const listener = yield* dataPlane.listen(
      options.dataListen ?? { _tag: "Tcp", host: controlHost, port: 0 },
      options.token
    )
    const weights = makeWeightStore({
      cacheDir: options.cacheDir ?? defaultSliceCacheDir((yield* Settings).cacheDir),
      ...(options.slicesOnly === undefined ? {} : { slicesOnly: options.slicesOnly }),
      ...(options.log === undefined ? {} : { log: options.log })
    })
    const host = yield* makeStageHost(listener, {
      weights,
      ...(options.log === undefined ? {} : { log: options.log }),
      token: options.token,
      threads: options.threads,
      backend: options.backend,
      ...(options.batch === undefined ? {} : { batch: options.batch }),
      ...(options.settleWeights === undefined ? {} : { settleWeights: options.settleWeights }),
      ...(options.memoryLimitBytes === undefined ? {} : { memoryLimitBytes: options.memoryLimitBytes }),
      ...(options.speedBytesPerSecond === undefined ? {} : { speedBytesPerSecond: options.speedBytesPerSecond }),
      ...(options.speedSource === undefined ? {} : { speedSource: options.speedSource }),
      ...(options.laterSpeed === undefined ? {} : { laterSpeed: options.laterSpeed }),
      ...(options.stepProbeRows === undefined ? {} : { stepProbeRows: options.stepProbeRows }),
      ...(options.devices === undefined ? {} : { devices: options.devices })
    })
    const advertised = options.dataAdvertise ?? listener.address
    const control = yield* serveControlRpc({
      address: options.listen,
      token: options.token,
      host,
      weights,
      hello: new AgentHello({ dataAddress: advertised, pid: process.pid })
    })
    return { control, data: listener.address }
  })
