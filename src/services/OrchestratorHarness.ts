/**
 * The seed's `OrchestratorHarness` test surface, on the real `RunActor` fiber: observe events, read the commands and
 * lifecycle events emitted so far, read the injected steps, advance time (a `TestClock`, so use it under
 * `it.effect` / `it.scoped`).
 */
import { Chunk, Effect, Queue, Ref, type Scope, TestClock } from "effect"
import type { LifecycleEvent, RunCommand, RunConfig, RunEvent } from "../domain/runEvents.js"
import { RunActor, type RunOutcome, type RunState } from "./RunFsm.js"

export interface OrchestratorHarness {
  readonly actor: RunActor
  /** Feeds one event to the actor and waits until it has been applied. */
  readonly observe: (event: RunEvent) => Effect.Effect<void>
  /** Every command emitted so far, in order. */
  readonly commands: Effect.Effect<ReadonlyArray<RunCommand>>
  /** Every lifecycle event emitted so far, in order. */
  readonly events: Effect.Effect<ReadonlyArray<LifecycleEvent>>
  /** The step numbers of every InjectTokenObject command so far, in order. */
  readonly injectedSteps: Effect.Effect<ReadonlyArray<number>>
  /** Moves the TestClock forward and waits until the actor has applied any deadline that passed. */
  readonly advanceTimeMs: (ms: number) => Effect.Effect<void>
  readonly state: Effect.Effect<RunState>
  /** The terminal outcome, if reached. */
  readonly outcome: Effect.Effect<RunOutcome | undefined>
}

const make = (config: RunConfig): Effect.Effect<OrchestratorHarness, never, Scope.Scope> =>
  Effect.gen(function* () {
    const actor = yield* Effect.orDie(RunActor.make(config))
    const commandQueue = yield* actor.subscribeCommands
    const eventQueue = yield* actor.subscribeLifecycle
    const commandLog = yield* Ref.make<ReadonlyArray<RunCommand>>([])
    const eventLog = yield* Ref.make<ReadonlyArray<LifecycleEvent>>([])

    // Everything the actor published before the last `send`/`sync` returned is already in the subscriptions.
    const drain = <A>(queue: Queue.Dequeue<A>, log: Ref.Ref<ReadonlyArray<A>>) =>
      Effect.flatMap(Queue.takeAll(queue), (chunk) =>
        Ref.updateAndGet(log, (xs) => [...xs, ...Chunk.toReadonlyArray(chunk)])
      )
    const commands = drain(commandQueue, commandLog)
    const events = drain(eventQueue, eventLog)

    return {
      actor,
      observe: actor.send,
      commands,
      events,
      injectedSteps: Effect.map(commands, (cs) =>
        cs.flatMap((c) => (c._tag === "InjectTokenObject" ? [c.object.step] : []))
      ),
      advanceTimeMs: (ms) => Effect.zipRight(TestClock.adjust(ms), actor.sync),
      state: actor.state,
      outcome: Effect.map(actor.state, (s) => s.outcome)
    }
  })

export const OrchestratorHarness = {
  /** The seed's `OrchestratorHarness::new(config)`: starts a run actor in the current scope. */
  make
}
