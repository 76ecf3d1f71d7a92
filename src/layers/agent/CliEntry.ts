/**
 * Which file a fresh `swactor` process runs (local agents, tests). The CLI bundle (dist/main.js, built by
 * scripts/build.mjs) names itself here before anything else: its code lives in dist/chunks/, not where the compiled
 * library's modules are, so LocalAgents cannot find it relative to its own file. No imports: main.ts loads this first.
 */
let bundledEntry: string | undefined

/** Called once by the CLI bundle's entry with its own path. */
export const setCliEntry = (path: string): void => {
  bundledEntry = path
}

/** The CLI entry this process was started from, when it is the bundle. */
export const cliEntry = (): string | undefined => bundledEntry
