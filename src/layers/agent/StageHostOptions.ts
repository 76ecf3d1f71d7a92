/** How a node agent's stage host runs its stages (StageHost.ts, HostedStage.ts). */
import type { Duration } from "effect"
import type { WeightStore } from "../gguf/SliceStore.js"
import type { BatcherSettings } from "./StageBatcher.js"
import type { Backend } from "../../domain/engine.js"
import type { NodeDevice } from "../../domain/controlRpc.js"
import type { Endianness } from "../../domain/wireFormats.js"

export interface StageHostOptions {
  /** The cluster token (data connections to the next stage prove it). */
  readonly token: string
  /** Default engine threads per stage. */
  readonly threads: number
  readonly backend: Backend
  /** How long unused weights stay loaded. */
  readonly modelIdleTimeToLive?: Duration.DurationInput
  /** How long a stage keeps retrying to reach its outbound peer. */
  readonly connectTimeout?: Duration.DurationInput
  /** Micro-batch size and prompt chunk of the per-weights stage batcher. */
  readonly batch?: BatcherSettings
  /**
   * When a stage moves its mapped weights to allocated memory (LoadedStage.settle): always, never, or auto (default:
   * warm weights or a long context; `swactor node` passes SWACTOR_MMAP_MOVE, config/Settings.ts).
   */
  readonly settleWeights?: "always" | "never" | "auto"
  /** Cap on the free memory this agent reports (`--memory-limit`): placement never gives it more. */
  readonly memoryLimitBytes?: number
  /** Weight bytes per second of this agent's engine (`--speed`, or measured at start), reported to placement. */
  readonly speedBytesPerSecond?: number
  readonly speedSource?: "declared" | "measured"
  /** Delivered slices: a stage loads the held or received file for its model path and blocks (weight delivery). */
  readonly weights?: WeightStore
  /** Operator-facing lines (which file a stage's weights load from). */
  readonly log?: (line: string) => void
  /** A speed measured after start (`--speed-probe after-ready`): reported once set, when none is declared. */
  readonly laterSpeed?: { current: number | undefined }
  /**
   * Measure each loaded stage's decode step at 1..N rows while it is idle (BatcherSettings.stepProbe), so the batcher
   * sizes decode micro-batches from measured costs from the first request on. 0 or absent: off (costs are then learnt
   * from the micro-batches served only).
   */
  readonly stepProbeRows?: number
  /** The node's ggml devices now (the live engine's Bindings.devices), reported in its capacity. */
  readonly devices?: () => ReadonlyArray<typeof NodeDevice.Type>
  /**
   * This host's byte order (default `os.endianness()`): on a big-endian one every stage is refused in one line
   * (`HostByteOrderUnsupported`, src/domain/wireFormats.ts). A test forces it.
   */
  readonly endianness?: Endianness
}
