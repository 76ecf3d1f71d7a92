/**
 * Which file a fresh `swactor` process runs (local agents, tests), when this process is the built command: the
 * command's loader (dist/main.js, written by scripts/build.mjs) records its own path under this global symbol before
 * it runs the bundle (dist/swactor.cjs), whose code does not sit where the compiled library's modules are.
 */
const entryKey = Symbol.for("swactor.cliEntry")

/** The command's entry (dist/main.js) when this process was started through it. */
export const cliEntry = (): string | undefined => {
  const entry = (globalThis as Record<symbol, unknown>)[entryKey]
  return typeof entry === "string" ? entry : undefined
}
