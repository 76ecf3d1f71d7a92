/**
 * `--discover` of run and serve (issue 39): the pool is the nodes that prove the cluster token on the LAN (and on this
 * host's loopback), heard for a few seconds on the discovery port (src/layers/discovery/DiscoveryListener.ts). Each
 * node found is a line on stderr; so is each sender not used, with the reason (another token, another protocol
 * version, one id announced by two live nodes). The addresses then go the `--agents` way: each control connection
 * still authenticates with the token before the node is used.
 */
import { Console, Effect, Redacted, Scope } from "effect"
import type { CachedSlice, DiscoveredNode, DiscoveryView } from "../domain/discovery.js"
import { encodeInvite } from "../domain/invite.js"
import * as DiscoveredPoolLive from "../layers/discovery/DiscoveredPoolLive.js"
import { type DiscoveredPoolService, poolAddresses } from "../services/DiscoveredPool.js"
import { discoveryInterfaces } from "../layers/discovery/NetInterfaces.js"
import type { SettingsValues } from "../layers/config/Settings.js"

/** How long `--discover` listens: a node announces every second, so every live node is heard at least twice. */
const discoverMillis = 3000

const gib = (bytes: number) => `${(bytes / 2 ** 30).toFixed(1)} GiB`

const nodeLine = (node: DiscoveredNode) =>
  `swactor: discovered node ${node.nodeId} at ${node.address}: ${gib(node.resources.freeMemoryBytes)} of ` +
  `${gib(node.resources.totalMemoryBytes)} free, ${node.resources.cores} cores, ${node.resources.backend}` +
  (node.resources.gpuTotalBytes === undefined ? "" : `, GPU ${gib(node.resources.gpuTotalBytes)}`) +
  cachedText(node.resources.cached ?? [])

/** `; holds MODEL blocks [a, b) of N, ...`: the slices a node's cache holds, as it announced them. */
const cachedText = (cached: ReadonlyArray<CachedSlice>) =>
  cached.length === 0
    ? ""
    : `; holds ${cached.map((c) => `${c.model} blocks [${c.layerStart}, ${c.layerEndExclusive}) of ${c.numLayers}`).join(", ")}`

/** The view's lines: the nodes found, then every sender not used with its reason. */
const viewLines = (view: DiscoveryView): ReadonlyArray<string> => [
  ...view.verified.map(nodeLine),
  ...view.refused.map(
    (r) => `swactor: not used: ${r.nodeId === undefined ? "" : `node ${r.nodeId} `}at ${r.from}: ${r.reason}`
  ),
  ...view.otherVersions.map((r) => `swactor: not used: ${r.reason}`),
  ...view.conflicts.map((c) => `swactor: not used: ${c.reason}`)
]

/** The address an invite of this host names: its first LAN interface's IPv4 (else loopback), the discovery port. */
export const inviteAddress = (settings: SettingsValues): string =>
  `${discoveryInterfaces()[0]?.address ?? "127.0.0.1"}:${settings.discoveryPort}`

/** The line `serve --discover` prints at start: the invite (this host's address and the token) and how to use it. */
const inviteLine = (token: string, settings: SettingsValues) =>
  `swactor: invite (swactor node --join <it> on a machine multicast does not reach): ` +
  encodeInvite({ address: inviteAddress(settings), token })

/**
 * The nodes proving `token`, after listening: their control addresses, and the discovered pool (the listener), kept
 * open in `keep` when given (`serve --discover`: for the server's life, each node joining or leaving said on stderr
 * from then on), else closed. Left: none found, in one line. `invite`: the invite line is printed once the port is
 * bound.
 */
export const discoveredAgents = (
  token: string,
  settings: SettingsValues,
  invite = false,
  keep?: Scope.Scope
): Effect.Effect<{ readonly addresses: ReadonlyArray<string>; readonly pool: DiscoveredPoolService }, string> => {
  let listed = false
  const found = Effect.gen(function* () {
    const pool = yield* DiscoveredPoolLive.make({
      token: Redacted.make(token),
      port: settings.discoveryPort,
      interfaces: { loopback: true },
      log: (line) => {
        if (listed) process.stderr.write(`${line}\n`)
      }
    }).pipe(
      Effect.mapError((error) => `--discover: cannot listen on UDP port ${settings.discoveryPort}: ${error.message}`)
    )
    if (invite) yield* Console.error(inviteLine(token, settings))
    yield* Effect.sleep(discoverMillis)
    const view = yield* pool.view
    yield* Effect.forEach(viewLines(view), (line) => Console.error(line), { discard: true })
    // the nodes listed: from now on (serve), a node joining or leaving is a line of its own
    yield* Effect.sleep(300)
    listed = true
    if (view.verified.length === 0)
      return yield* Effect.fail(
        `--discover: no node proving the cluster token was heard on UDP port ${settings.discoveryPort} in ` +
          `${discoverMillis / 1000} s (start \`swactor node --listen 0.0.0.0:7070\` with the same token on each ` +
          `machine, or name them with --agents)`
      )
    return { addresses: poolAddresses(view), pool }
  })
  return keep === undefined ? Effect.scoped(found) : Scope.extend(found, keep)
}
