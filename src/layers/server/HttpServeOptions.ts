/** The HTTP front's options (HttpServe.ts), read by its routes and its Node server alike. */
import type { Redacted } from "effect"
import { defaultHttpLimits, type HttpLimits } from "./HttpGuard.js"

export interface HttpServeOptions {
  readonly host?: string
  readonly port?: number
  /** Comment lines on an open SSE stream while no event comes (default 5 s). */
  readonly keepAliveMillis?: number
  /** Called with the bound address once listening. */
  readonly onListening?: (address: { readonly host: string; readonly port: number }) => void
  /** The model's name in responses (default: the file's name). */
  readonly modelName?: string
  /** Body, connection and caller limits (HttpGuard.ts; defaults there). */
  readonly limits?: Partial<HttpLimits>
  /** API keys a caller must present (Authorization: Bearer, or x-api-key) on every route but /health; none: open. */
  readonly apiKeys?: ReadonlyArray<Redacted.Redacted<string>>
}

/** The limits with their defaults filled in. */
export const limitsOf = (options: HttpServeOptions): HttpLimits => ({ ...defaultHttpLimits, ...options.limits })
