/**
 * Discovery benchmark (not a test, issue 39): how fast a running `swactor serve --discover` takes in a node that starts
 * and lets go of one killed. On loopback with a private discovery port: two `swactor node`s, a server over them, then
 * per round a third node started (its process launched → the first token of the first request that started after
 * the server re-planned onto it) and killed with SIGKILL (→ the server's line that it left the discovered pool, and →
 * /api/status showing it lost). Every node declares 1 MB/s (`--speed 1e6`), so a third stage makes the plan faster by
 * more than the default margin and the server re-plans onto it. Targets (issue 39): used within 3 s, gone within 5 s.
 *
 *   npm run bench:discovery
 *
 * Settings (environment): BENCH_ROUNDS (3), SWACTOR_MODELS_DIR (../shared/models). Needs dist/ (the npm script builds).
 */
import { type ChildProcess, spawn } from "node:child_process"
import { randomBytes } from "node:crypto"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const rounds = Number(process.env.BENCH_ROUNDS ?? "3")
const model = join(resolve(root, process.env.SWACTOR_MODELS_DIR ?? "../shared/models"), "stories260K.gguf")
const main = join(root, "dist", "main.js")
const dir = mkdtempSync(join(tmpdir(), "swactor-bench-discovery-"))
const env = {
  ...process.env,
  SWACTOR_CLUSTER_TOKEN: randomBytes(24).toString("hex"),
  SWACTOR_DISCOVERY_PORT: String(22000 + (process.pid % 20000))
}
const children: Array<ChildProcess> = []
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))

/** A child whose stderr is kept; `lines()` is all of it so far. */
const launch = (args: ReadonlyArray<string>, extraEnv: Record<string, string> = {}) => {
  const child = spawn(process.execPath, [main, ...args], {
    cwd: root,
    stdio: ["ignore", "pipe", "pipe"],
    env: { ...env, ...extraEnv }
  })
  children.push(child)
  let text = ""
  child.stderr!.on("data", (chunk) => (text += chunk))
  child.stdout!.on("data", (chunk) => (text += chunk))
  return { child, lines: () => text }
}

/** Polls `check` every 10 ms until it holds (at most `ms`); the time it first held. */
const when = async (check: () => boolean | Promise<boolean>, ms: number, what: string) => {
  for (const until = Date.now() + ms; Date.now() < until; await sleep(10)) if (await check()) return performance.now()
  throw new Error(`${what}: not within ${ms} ms`)
}

const startNode = (name: string) =>
  launch(["node", "--listen", "127.0.0.1:0", "--threads", "1", "--speed", "1e6"], {
    XDG_STATE_HOME: join(dir, name)
  })

/** The first token of one streamed request: when it came. */
const firstToken = async (url: string) => {
  const response = await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 8, temperature: 0, stream: true })
  })
  const reader = response.body!.getReader()
  await reader.read()
  const at = performance.now()
  while (!(await reader.read()).done);
  return at
}

const nodeState = async (url: string, address: string) =>
  (
    (await fetch(`${url}/api/status`).then((r) => r.json())) as { nodes: Array<{ address: string; state: string }> }
  ).nodes.find((n) => n.address === address)?.state

/** One round: a node started and used, then killed and gone. */
const round = async (url: string, serve: ReturnType<typeof launch>, i: number) => {
  const replans = serve.lines().split("re-planned onto").length
  const started = performance.now()
  const node = startNode(`n${i}`)
  const id = await when(() => /announcing node [0-9a-f]{32}/.test(node.lines()), 10_000, "the node's id").then(
    () => /announcing node ([0-9a-f]{32})/.exec(node.lines())![1]!
  )
  // requests back to back; the first one that starts after the re-plan uses the node
  let used: number | undefined
  while (used === undefined && performance.now() - started < 60_000) {
    const replanned = serve.lines().split("re-planned onto").length > replans
    const at = await firstToken(url)
    if (replanned) used = at
  }
  if (used === undefined) throw new Error(`never re-planned onto the new node:\n${serve.lines()}`)
  const address = new RegExp(`node ${id} at (\\S+) joined`).exec(serve.lines())?.[1] ?? ""
  const killed = performance.now()
  node.child.kill("SIGKILL")
  const left = await when(() => new RegExp(`node ${id} at \\S+ left`).test(serve.lines()), 30_000, "left")
  const lost = await when(async () => (await nodeState(url, address)) === "lost", 30_000, "lost")
  return { usedS: (used - started) / 1000, leftS: (left - killed) / 1000, lostS: (lost - killed) / 1000 }
}

const run = async () => {
  startNode("a")
  startNode("b")
  await sleep(1500)
  const serve = launch(["serve", "--model", model, "--discover", "--port", "0", "--threads", "1"])
  await when(() => /ready:/.test(serve.lines()), 60_000, "serve ready")
  const url = /listening on (http:\/\/\S+)/.exec(serve.lines())![1]!
  console.log(`bench:discovery: stories260K, serve --discover over 2 nodes on loopback, ${rounds} rounds`)
  console.log("round  node start → a request uses it   SIGKILL → left the pool   SIGKILL → lost on /api/status")
  const results: Array<Awaited<ReturnType<typeof round>>> = []
  for (let i = 1; i <= rounds; i++) {
    const r = await round(url, serve, i)
    results.push(r)
    console.log(
      `${String(i).padStart(5)}  ${r.usedS.toFixed(2).padStart(26)} s  ${r.leftS.toFixed(2).padStart(21)} s  ` +
        `${r.lostS.toFixed(2).padStart(27)} s`
    )
    // the old pipeline drains and the killed node's expiry settles before the next node
    await sleep(1500)
  }
  const worst = (k: "usedS" | "leftS" | "lostS") => Math.max(...results.map((r) => r[k]))
  console.log(
    `worst: used ${worst("usedS").toFixed(2)} s (target < 3 s), left ${worst("leftS").toFixed(2)} s, ` +
      `lost ${worst("lostS").toFixed(2)} s (target < 5 s)`
  )
}

try {
  await run()
} finally {
  for (const child of children) child.kill("SIGKILL")
  rmSync(dir, { recursive: true, force: true })
}
