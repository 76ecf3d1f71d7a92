/**
 * Where a run's events come from besides its actor's clock: the commands the run FSM emits, executed (each forked,
 * since a stage's provisioning waits for its load; the FSM orders what must be ordered), the pool losing a node of
 * the run, and the operator's stop.
 */
import { Deferred, Effect, Queue, Schedule, type Scope } from "effect"
import { type RunCommand, RunEvents } from "../../domain/runEvents.js"
import { noteDetail, type RunContext } from "./RunContext.js"
import { hostStage } from "./StageHosting.js"
import { injectTokenObject, openTokenIn, openTokenOut, tearDownTokenEndpoints } from "./TokenEndpoints.js"

/** Executes one command of the run FSM. */
const executeCommand = (context: RunContext, command: RunCommand): Effect.Effect<void> => {
  switch (command._tag) {
    case "ProvisionStage":
      return hostStage(context, command.provision)
    case "CreateTokenInEndpoint":
      return openTokenIn(context, command.edge)
    case "CreateTokenOutEndpoint":
      return openTokenOut(context, command.edge)
    case "InjectTokenObject":
      return injectTokenObject(context, command)
    case "StopRun":
      return context.warm
        .linkOf(command.nodeId)
        .stop(context.runId, command.stageIndex)
        .pipe(
          // An agent we cannot reach hosts nothing any more.
          Effect.catchAll(() =>
            context.offer(RunEvents.StageStopped({ runId: context.runId, stageIndex: command.stageIndex }))
          )
        )
    case "TearDownTokenEndpoints":
      return tearDownTokenEndpoints(context)
  }
}

/** Executes the run FSM's commands as they come, each forked in `workers`, for as long as the run's scope lives. */
export const executeCommands = (context: RunContext, commands: Queue.Dequeue<RunCommand>, workers: Scope.Scope) =>
  Queue.take(commands).pipe(
    Effect.flatMap((command) => Effect.forkIn(executeCommand(context, command), workers)),
    Effect.forever,
    Effect.forkScoped
  )

/**
 * Watches the pool for a node of this run lost (other nodes of the pool may come and go: spares, nodes lost before
 * this run), and tells the run once.
 */
export const watchRunNodes = (context: RunContext) => {
  const planNodes = new Set<number>(context.plan.stages.map((s) => s.nodeId))
  return context.warm.pool.status.pipe(
    Effect.flatMap((status) => {
      for (const [nodeId, s] of status) {
        if (s._tag === "Lost" && planNodes.has(nodeId)) return Effect.succeed(s.lost)
      }
      return Effect.fail(undefined)
    }),
    Effect.retry(Schedule.spaced("50 millis")),
    Effect.flatMap((lost) =>
      Effect.zipRight(
        Effect.sync(() => noteDetail(context, `node:${lost.node.nodeId}`, lost.reason)),
        context.offer(RunEvents.MembershipLost({ runId: context.runId, nodeId: lost.node.nodeId }))
      )
    ),
    Effect.forkScoped
  )
}

/** Completing `stopRequested` is the operator's stop of the run. */
export const forwardOperatorStop = (context: RunContext, stopRequested: Deferred.Deferred<void>) =>
  Deferred.await(stopRequested).pipe(
    Effect.zipRight(context.offer(RunEvents.OperatorStop({ runId: context.runId }))),
    Effect.forkScoped
  )
