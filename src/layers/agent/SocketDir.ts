/** Private folders for same-host Unix sockets (a local pool's data plane). */
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect, type Scope } from "effect"
import { AgentSpawnError } from "../../services/AgentLinks.js"

/** Private socket directories still present, removed synchronously if this process exits without closing its scopes. */
const liveDirs = new Set<string>()
let dirHookInstalled = false
const installDirHook = () => {
  if (dirHookInstalled) return
  dirHookInstalled = true
  process.on("exit", () => {
    for (const dir of liveDirs) rmSync(dir, { recursive: true, force: true })
  })
}

/**
 * A fresh directory only this user can enter (mkdtemp: mode 0700) for same-host Unix sockets, removed
 * with everything in it when the scope closes (or when this process exits). Under /tmp when the
 * temp dir's path would leave no room in a socket path (about 107 bytes).
 */
export const privateSocketDir: Effect.Effect<string, AgentSpawnError, Scope.Scope> = Effect.acquireRelease(
  Effect.try({
    try: () => {
      installDirHook()
      const base = tmpdir().length > 60 ? "/tmp" : tmpdir()
      const dir = mkdtempSync(join(base, "swactor-"))
      liveDirs.add(dir)
      return dir
    },
    catch: (cause) => new AgentSpawnError({ index: -1, message: `cannot create a socket directory: ${String(cause)}` })
  }),
  (dir) =>
    Effect.sync(() => {
      liveDirs.delete(dir)
      rmSync(dir, { recursive: true, force: true })
    })
)
