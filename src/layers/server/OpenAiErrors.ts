/**
 * OpenAI's error shape, `{"error":{"message","type","param","code"}}`, for every refusal of the HTTP front: 400 bad
 * body, 429 + Retry-After when the admission queue is full, 503 + Retry-After while loading or reviving, 500 with the
 * fault in words (agents' addresses left out; the whole message goes to the log under a reference the client gets).
 */
import { randomBytes } from "node:crypto"
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import { ParseResult } from "effect"
import type { ServeError } from "../../services/Server.js"
import { clip, type EdgeRefusal, withoutAddresses } from "./HttpGuard.js"

export class HttpFailure {
  constructor(
    readonly status: number,
    readonly type: string,
    readonly message: string,
    readonly code: string | null = null,
    readonly retryAfter?: number
  ) {}
}

export const errorJson = (failure: HttpFailure | EdgeRefusal) => ({
  error: { message: clip(failure.message), type: failure.type, param: null, code: failure.code }
})

export const errorResponse = (failure: HttpFailure | EdgeRefusal) =>
  HttpServerResponse.unsafeJson(errorJson(failure), {
    status: failure.status,
    headers: {
      ...(failure instanceof HttpFailure && failure.retryAfter !== undefined
        ? { "retry-after": String(failure.retryAfter) }
        : {}),
      // A body refused before it was read whole: the connection is not reused (what is left of the body is never read).
      ...(failure.status === 413 || failure.status === 408 ? { connection: "close" } : {})
    }
  })

/** A server-side fault in words for the client, without agents' addresses; the whole message goes to the log. */
export const faultForClient = (message: string): string => {
  const reference = randomBytes(4).toString("hex")
  process.stderr.write(`swactor serve: request failed [${reference}]: ${message}\n`)
  return `${withoutAddresses(message)} [log reference ${reference}]`
}

export const fromServeError = (error: ServeError): HttpFailure => {
  switch (error._tag) {
    case "BadServeRequest":
      return new HttpFailure(400, "invalid_request_error", error.message)
    case "ServerBusy":
      return new HttpFailure(429, "rate_limit_error", error.message, "queue_full", error.retryAfterSeconds)
    case "ServerLoading":
      return new HttpFailure(503, "server_error", error.message, "loading", 5)
    case "ServerReviving":
      return new HttpFailure(503, "server_error", error.message, "reviving", error.retryAfterSeconds)
    case "PipelineFaulted":
      return new HttpFailure(
        500,
        "server_error",
        faultForClient(`the pipeline faulted: ${error.message}`),
        "pipeline_faulted"
      )
    default:
      return new HttpFailure(
        500,
        "server_error",
        faultForClient(String((error as { message?: unknown }).message ?? error))
      )
  }
}

/** A body that does not fit the route's schema: each issue with its path, each clipped (a bad value is not echoed whole). */
export const badBody = (error: ParseResult.ParseError) =>
  new HttpFailure(
    400,
    "invalid_request_error",
    clip(
      `bad request body: ${ParseResult.ArrayFormatter.formatErrorSync(error)
        .slice(0, 4)
        .map((issue) => `${issue.path.length > 0 ? `${issue.path.join(".")}: ` : ""}${clip(issue.message, 160)}`)
        .join("; ")}`
    )
  )
