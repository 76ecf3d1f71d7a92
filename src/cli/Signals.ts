/**
 * Operator stops for long-running commands (`swactor run`, `swactor node`, `swactor serve`): SIGINT, SIGTERM and
 * SIGHUP, and a closed stdout (`swactor run ... | head`), all mean "stop now, cleanly".
 */
import * as Os from "node:os"
import { Deferred, Effect, Exit, Fiber, Option } from "effect"

/** The signals a long-running command treats as an operator stop. */
export const operatorSignals = ["SIGINT", "SIGTERM", "SIGHUP"] as const
export type OperatorSignal = (typeof operatorSignals)[number]

/** Why a command was stopped, and the exit status it leaves (128 + the signal number; 0 for a closed stdout). */
export type OperatorStop =
  | { readonly _tag: "Signal"; readonly signal: OperatorSignal; readonly exitCode: number }
  | { readonly _tag: "OutputClosed"; readonly exitCode: 0 }

/** 128 + the signal's number, as a shell reports a program ended by that signal (130, 143, 129). */
export const signalExitCode = (signal: OperatorSignal): number => 128 + Os.constants.signals[signal]

export interface OperatorStopOptions {
  /** Runs after the command's teardown finished (its scopes closed): say what happened, on stderr. */
  readonly onStop?: (stop: OperatorStop) => Effect.Effect<void>
  /** Treat EPIPE on stdout (the reader went away) as a stop with exit 0 (default true). */
  readonly stdoutClosedStops?: boolean
}

let stdoutClosed = false

/**
 * Runs a long-running command until it ends or an operator stops it. THE signal handling of every long-running
 * `swactor` command: use it, do not install signal listeners elsewhere.
 *
 * - SIGINT, SIGTERM or SIGHUP (the first one) interrupts `command` and waits for its teardown (every finalizer and
 *   scope it opened: agents stopped, sockets and shared-memory files removed), then calls `onStop` and succeeds with
 *   `None`; `process.exitCode` is set to 128 + the signal number (130, 143, 129).
 * - A second signal while the teardown runs exits at once with that status (the process exit hooks still kill
 *   local agents and remove socket folders synchronously).
 * - EPIPE on stdout (`| head` closed the pipe) is the same stop with exit status 0 and no complaint; later writes
 *   to the closed stdout (and to a closed stderr) are dropped instead of crashing the process.
 * - When `command` ends by itself, its result comes back as `Some` (or its failure as the failure), untouched.
 *
 * The program's main runner (src/main.ts) must exit with `process.exitCode` once the main fiber ends, and must not
 * install its own signal listeners.
 */
export const untilOperatorStop = <A, E, R>(
  command: Effect.Effect<A, E, R>,
  options: OperatorStopOptions = {}
): Effect.Effect<Option.Option<A>, E, R> =>
  Effect.gen(function* () {
    const stopped = yield* Deferred.make<OperatorStop>()
    let first: OperatorStop | undefined
    const stopWith = (stop: OperatorStop) => {
      if (first !== undefined) {
        if (stop._tag === "Signal") process.exit(stop.exitCode)
        return
      }
      first = stop
      process.exitCode = stop.exitCode
      Deferred.unsafeDone(stopped, Exit.succeed(stop))
    }
    const listeners = operatorSignals.map((signal) => {
      const listener = () => stopWith({ _tag: "Signal", signal, exitCode: signalExitCode(signal) })
      return { signal, listener }
    })
    const onStdoutError = (error: NodeJS.ErrnoException) => {
      if (error.code !== "EPIPE") return
      stdoutClosed = true
      stopWith({ _tag: "OutputClosed", exitCode: 0 })
    }
    const ignoreStderrError = () => {}
    const install = Effect.sync(() => {
      for (const { listener, signal } of listeners) process.on(signal, listener)
      if (options.stdoutClosedStops !== false) process.stdout.on("error", onStdoutError)
      process.stderr.on("error", ignoreStderrError)
    })
    const uninstall = Effect.sync(() => {
      for (const { listener, signal } of listeners) process.off(signal, listener)
      process.stdout.off("error", onStdoutError)
      process.stderr.off("error", ignoreStderrError)
      // A stdout that closed stays closed: late writes must not raise an unhandled 'error'.
      if (stdoutClosed && process.stdout.listenerCount("error") === 0) process.stdout.on("error", () => {})
    })
    return yield* Effect.acquireUseRelease(
      install,
      () =>
        Effect.gen(function* () {
          const fiber = yield* Effect.fork(command)
          const watcher = yield* Effect.fork(Deferred.await(stopped).pipe(Effect.zipRight(Fiber.interrupt(fiber))))
          const exit = yield* Fiber.await(fiber)
          yield* Fiber.interrupt(watcher)
          if (first !== undefined && (Exit.isInterrupted(exit) || Exit.isFailure(exit))) {
            if (options.onStop !== undefined) yield* options.onStop(first)
            return Option.none<A>()
          }
          return Option.some(yield* exit)
        }),
      () => uninstall
    )
  })
