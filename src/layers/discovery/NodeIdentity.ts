/**
 * A node's persistent id (issue 39): 16 random bytes in hex, made once and kept in a file of its state folder
 * (Settings' `stateDir`, `$XDG_STATE_HOME/swactor`), so a restarted node is the same node to the cluster. Created with
 * an exclusive open, so two processes starting at once agree on one id. `swactor node` keeps one file per control
 * port (`node-7070.id`), so two nodes of one host have two ids, and a node on an ephemeral port has a fresh one.
 */
import { randomBytes } from "node:crypto"
import { mkdirSync, readFileSync, writeFileSync } from "node:fs"
import * as Path from "node:path"
import { Effect } from "effect"

const ID_PATTERN = /^[0-9a-f]{32}$/

/** A fresh id, kept nowhere (a node on an ephemeral port). */
export const ephemeralNodeId = (): string => randomBytes(16).toString("hex")

/** The id kept in `stateDir` (made there on first use). Fails with the file's problem in one line. */
export const persistentNodeId = (stateDir: string, fileName = "node-id"): Effect.Effect<string, Error> =>
  Effect.try({
    try: () => {
      const file = Path.join(stateDir, fileName)
      mkdirSync(stateDir, { recursive: true, mode: 0o700 })
      try {
        writeFileSync(file, `${randomBytes(16).toString("hex")}\n`, { flag: "wx", mode: 0o600 })
      } catch (cause) {
        if ((cause as NodeJS.ErrnoException).code !== "EEXIST") throw cause
      }
      const id = readFileSync(file, "utf8").trim()
      if (!ID_PATTERN.test(id)) throw new Error(`${file} does not hold a node id (32 hex digits): remove it`)
      return id
    },
    catch: (cause) => (cause instanceof Error ? cause : new Error(String(cause)))
  })
