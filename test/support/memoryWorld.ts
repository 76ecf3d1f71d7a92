/**
 * In-memory agents for library-level tests: the test engine (StageExecutorTest on the stories model's shape) with a
 * known delay per batched forward, and the live Orchestrator over a memory world of agents.
 */
import { Context, Effect, Layer, Stream } from "effect"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import type { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import { AgentControl, type ProvisionRequest, type StageReport } from "../../src/services/AgentLinks.js"
import { Orchestrator } from "../../src/services/Orchestrator.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { storiesTestModel } from "./models.js"

/** The test engine, each batched forward (every stage's work goes through the agents' batcher) `delayMillis` slower. */
export const delayedTestExecutor = (delayMillis: number) => {
  const base = StageExecutorTest.make(storiesTestModel)
  return Layer.succeed(StageExecutor, {
    load: base.load,
    session: base.session,
    forwardBatch: (items) => Effect.delay(base.forwardBatch(items), delayMillis)
  })
}

type MemoryWorld = Effect.Effect.Success<ReturnType<typeof makeMemoryWorld>>

/**
 * What the live Orchestrator (or a Server over it) needs besides the agents: tokenizer double, membership, catalog;
 * with the memory world's agent links, or `links` over them (tapReports, tapProvisions).
 */
export const memoryWorldServices = (memory: MemoryWorld, links: MemoryWorld["layer"] = memory.layer) =>
  Layer.mergeAll(links, TokenizerLive.layerTest, MembershipLive.layer, ModelCatalogLive.layer)

/** The live Orchestrator over the memory world's agents (or `links` over them). */
export const memoryOrchestrator = (memory: MemoryWorld, links: MemoryWorld["layer"] = memory.layer) =>
  Layer.build(OrchestratorLive.layer.pipe(Layer.provide(memoryWorldServices(memory, links)))).pipe(
    Effect.map(Context.get(Orchestrator))
  )

/**
 * The memory world's agent links, with every provision request the orchestrator sends shown to `onRequest` and every
 * stage report it receives shown to `onReport`, each first.
 */
const tapLinks = (
  memory: MemoryWorld,
  taps: {
    readonly onRequest?: (request: ProvisionRequest) => void
    readonly onReport?: (report: StageReport) => void
  }
) =>
  Layer.effect(
    AgentControl,
    Effect.map(AgentControl, (control) =>
      AgentControl.of({
        connect: (node, token) =>
          Effect.map(control.connect(node, token), (link) => ({
            ...link,
            provision: (request) =>
              Stream.suspend(() => {
                taps.onRequest?.(request)
                return link.provision(request).pipe(Stream.tap((r) => Effect.sync(() => taps.onReport?.(r))))
              })
          }))
      })
    )
  ).pipe(Layer.provideMerge(memory.layer))

/** The memory world's agent links, with every stage report the orchestrator receives shown to `onReport` first. */
export const tapReports = (memory: MemoryWorld, onReport: (report: StageReport) => void) =>
  tapLinks(memory, { onReport })

/** The memory world's agent links, with every provision request the orchestrator sends shown to `onRequest` first. */
export const tapProvisions = (memory: MemoryWorld, onRequest: (request: ProvisionRequest) => void) =>
  tapLinks(memory, { onRequest })
