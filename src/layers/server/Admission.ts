/**
 * The server's admission: FIFO, by KV bytes per stage and a parallel limit, with a bounded queue. What a request
 * takes is asked of the KV sizing (KvSizing.ts) each time, so a pipeline that changed shape re-weighs every
 * reservation at once; what else the budget holds (the prompt cache's entries) gives way to a request that needs it.
 */
import { Deferred, Effect, Exit } from "effect"
import { ServerBusy, type ServeError } from "../../services/Server.js"
import type { KvSizing } from "./KvSizing.js"

interface Ticket {
  /** The request's KV context (its bytes per stage follow the pipeline's current shape). */
  readonly contextLength: number
  readonly ready: Deferred.Deferred<void, ServeError>
  admitted: boolean
  /** Run when the ticket is released, before waiting tickets are admitted (a finished run's KV becomes an entry). */
  onRelease?: () => void
}

/** What else the budget holds: the prompt cache's entries, evicted (least recently used first) to make room. */
export interface HeldKv {
  readonly bytes: () => number
  readonly evictWhile: (needMore: () => boolean) => void
}

/**
 * FIFO admission: a request runs when it fits the KV budget and the parallel limit; at most `limit` wait. Sizes are
 * read from `sizing` each time, so a pipeline that changed shape (fewer stages after a recovery) re-weighs every
 * reservation at once (`reshaped`).
 */
export const make = (sizing: KvSizing, parallel: number, limit: number, held?: HeldKv) => {
  const admitted = new Set<Ticket>()
  const queue: Array<Ticket> = []
  const used = () => {
    let sum = 0
    for (const ticket of admitted) sum += sizing.bytes(ticket.contextLength)
    return sum
  }
  const over = (contextLength: number) => used() + sizing.bytes(contextLength) + (held?.bytes() ?? 0) > sizing.budget()
  // held entries not in use give way to a request that needs their memory
  const fits = (contextLength: number) => {
    if (admitted.size >= parallel) return false
    if (over(contextLength)) held?.evictWhile(() => over(contextLength))
    return !over(contextLength)
  }
  const admit = (ticket: Ticket) => {
    ticket.admitted = true
    admitted.add(ticket)
    Deferred.unsafeDone(ticket.ready, Exit.void)
  }
  const pump = () => {
    while (queue.length > 0 && fits(queue[0]!.contextLength)) admit(queue.shift()!)
  }
  return {
    state: () => ({ used: used(), running: admitted.size, queued: queue.length }),
    /**
     * Admitted (or queued) for the rest of the scope: refused at once when the queue is full; otherwise `wait`
     * completes on admission. `ahead` is how many wait before it (0 when admitted at once).
     */
    enter: (contextLength: number) =>
      Effect.gen(function* () {
        const ticket: Ticket = { contextLength, ready: yield* Deferred.make<void, ServeError>(), admitted: false }
        if (queue.length === 0 && fits(contextLength)) admit(ticket)
        else if (queue.length >= limit) {
          return yield* new ServerBusy({
            queued: queue.length,
            retryAfterSeconds: 1 + Math.floor(queue.length / parallel),
            message: `the server is busy: ${admitted.size} requests running and ${queue.length} queued (the queue holds ${limit})`
          })
        } else queue.push(ticket)
        let released = false
        const release = () => {
          if (released) return
          released = true
          if (ticket.admitted) admitted.delete(ticket)
          else {
            const at = queue.indexOf(ticket)
            if (at >= 0) queue.splice(at, 1)
          }
          ticket.onRelease?.()
          pump()
        }
        yield* Effect.addFinalizer(() => Effect.sync(release))
        return {
          ahead: ticket.admitted ? 0 : queue.length,
          admitted: ticket.admitted,
          wait: Deferred.await(ticket.ready),
          /** `f` runs when the ticket is released (at the latest when the scope closes). */
          onRelease: (f: () => void) => void (ticket.onRelease = f),
          /** Releases it now (its run ended and was torn down: its KV is freed or kept as an entry). */
          release
        }
      }),
    /** The sizes changed: waiting requests that can never fit now are refused, the others admitted as room allows. */
    reshaped: (tooLong: (contextLength: number) => ServeError) =>
      Effect.sync(() => {
        for (const ticket of [...queue]) {
          if (sizing.bytes(ticket.contextLength) <= sizing.budget()) continue
          queue.splice(queue.indexOf(ticket), 1)
          Deferred.unsafeDone(ticket.ready, Exit.fail(tooLong(ticket.contextLength)))
        }
        pump()
      }),
    /** Fails every waiting request (the pipeline faulted). */
    failAll: (error: ServeError) =>
      Effect.sync(() => {
        for (const ticket of queue.splice(0)) Deferred.unsafeDone(ticket.ready, Exit.fail(error))
      })
  }
}

/** An admission (make). */
export type Admission = ReturnType<typeof make>
