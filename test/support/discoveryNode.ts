// One discovery node for test/discovery/discoveryNetns.test.ts, run inside a network namespace: its persistent id
// from SWACTOR_TEST_STATE_DIR, an announcer and a listener on the namespace's interfaces (the default choice: no
// loopback, no virtual ones) until it has verified SWACTOR_TEST_EXPECT ids (or SWACTOR_TEST_DEADLINE_MS passed),
// then one line `view {json}` with every id it verified.
import { Effect, Redacted } from "effect"
import { makeAnnouncer } from "../../src/layers/discovery/Announcer.js"
import { makeDiscoveryListener } from "../../src/layers/discovery/DiscoveryListener.js"
import { persistentNodeId } from "../../src/layers/discovery/NodeIdentity.js"

const env = (name: string) => process.env[name] ?? ""
const token = Redacted.make(env("SWACTOR_TEST_TOKEN"))

const program = Effect.gen(function* () {
  const nodeId = yield* persistentNodeId(env("SWACTOR_TEST_STATE_DIR"))
  const listener = yield* makeDiscoveryListener({ token })
  yield* makeAnnouncer({
    token,
    nodeId,
    address: env("SWACTOR_TEST_ADDRESS"),
    resources: () => ({ totalMemoryBytes: 1, freeMemoryBytes: 1, cores: 1, backend: "cpu" }),
    intervalMillis: 200,
    ttlMillis: Number(process.env["SWACTOR_TEST_TTL_MS"] ?? 5000)
  })
  if (env("SWACTOR_TEST_WATCH_MS") !== "") {
    // a timeline instead: the ids verified every 100 ms, one line each, for SWACTOR_TEST_WATCH_MS
    const end = Date.now() + Number(env("SWACTOR_TEST_WATCH_MS"))
    while (Date.now() < end) {
      const ids = (yield* listener.view).verified.map((node) => node.nodeId)
      console.log(`seen ${JSON.stringify({ nodeId, verified: ids })}`)
      yield* Effect.sleep("100 millis")
    }
    return
  }
  // every id verified at some point, until SWACTOR_TEST_EXPECT of them (or the deadline); then a linger, so that the
  // others (started later on a loaded machine) hear this node before it leaves
  const seen = new Set<string>()
  const deadline = Date.now() + Number(env("SWACTOR_TEST_DEADLINE_MS"))
  while (seen.size < Number(env("SWACTOR_TEST_EXPECT")) && Date.now() < deadline) {
    for (const node of (yield* listener.view).verified) seen.add(node.nodeId)
    yield* Effect.sleep("100 millis")
  }
  yield* Effect.sleep("2 seconds")
  for (const node of (yield* listener.view).verified) seen.add(node.nodeId)
  console.log(`view ${JSON.stringify({ nodeId, verified: [...seen] })}`)
}).pipe(Effect.scoped)

Effect.runPromise(program).catch((cause: unknown) => {
  console.error(String(cause))
  process.exit(1)
})
