/**
 * The console in a real browser (issue 39's proof, "The console in a real browser in CI"): Debian's `chromium`, driven
 * by playwright-core against the system binary (no browser download; .ci/run installs the package), opens `swactor
 * serve`'s page for stories260K on two local agents with an API key. The page asks for the key, then shows both nodes
 * ready and the plan over both; a chat streams its answer in several pieces. A node killed turns lost on the page,
 * and the pool serves on the other (the plan moves there, a chat answers). Screenshots are kept in test-artifacts/
 * (git-ignored).
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import { existsSync, mkdirSync } from "node:fs"
import { join } from "node:path"
import { randomBytes } from "node:crypto"
import { type Browser, chromium } from "playwright-core"
import { repoRoot, requireModel } from "../support/models.js"
import { agentsOf, type ServeProcess, startServe, stopServe } from "../support/serve.js"

const model = requireModel("stories260K.gguf")
const key = randomBytes(24).toString("hex")
const chromiumPath = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].find((path) => existsSync(path))
const artifacts = join(repoRoot, "test-artifacts")

describe("the console page in Debian's chromium", () => {
  let server: ServeProcess
  let browser: Browser
  beforeAll(async () => {
    if (chromiumPath === undefined) throw new Error("chromium is missing: apt-get install chromium (.ci/run does)")
    server = await startServe(["--model", model, "--stages", "2", "--threads", "1"], { SWACTOR_API_KEY: key })
    // root (CI) needs --no-sandbox; the page is this test's own server's
    browser = await chromium.launch({ executablePath: chromiumPath, headless: true, args: ["--no-sandbox"] })
  }, 180_000)
  afterAll(async () => {
    await browser?.close()
    await stopServe(server)
  })

  it("asks for the key, shows the nodes and the plan, streams a chat; a screenshot is kept", async () => {
    const page = await browser.newPage({ viewport: { width: 1100, height: 1000 } })
    const problems: Array<string> = []
    page.on("pageerror", (error) => problems.push(String(error)))
    await page.goto(`${server.url}/`)
    // without the key: the page asks for it
    await page.locator("#key-form").waitFor({ state: "visible", timeout: 10_000 })
    await page.locator("#key-input").fill(key)
    await page.locator("#key-send").click()
    // both nodes ready, the plan over both
    await page.locator("#nodes tbody tr[data-state=ready]").nth(1).waitFor({ timeout: 20_000 })
    const nodes = await page
      .locator("#nodes tbody tr")
      .evaluateAll((rows) =>
        rows.map((r) => ({ address: (r as HTMLElement).dataset.address, text: r.textContent ?? "" }))
      )
    assert.strictEqual(nodes.length, 2)
    for (const n of nodes) assert.match(n.text, /ready[\d.]+ [KMG]iB \/ [\d.]+ [KMG]iB\d+cpu/)
    const plan = await page
      .locator("#plan tbody tr")
      .evaluateAll((rows) => rows.map((r) => [...r.querySelectorAll("td")].map((td) => td.textContent ?? "")))
    assert.strictEqual(plan.length, 2)
    assert.sameMembers(
      plan.map((cells) => cells[2]),
      nodes.map((n) => n.address)
    )
    assert.match(plan[0]![1]!, /^0–\d+$/)
    assert.include(await page.locator("#models").textContent(), "stories260K.gguf")
    // a chat: its answer grows piece by piece as the tokens stream
    await page.evaluate(() => {
      const w = window as unknown as { seen: Array<number> }
      w.seen = []
      new MutationObserver(() => {
        const answer = document.querySelector("#chat-output .assistant")
        if (answer !== null) w.seen.push(answer.textContent?.length ?? 0)
      }).observe(document.getElementById("chat-output")!, { childList: true, subtree: true, characterData: true })
    })
    await page.locator("#chat-input").fill("Once upon a time")
    await page.locator("#chat-send").click()
    await page.locator("#chat-output .assistant[data-done=true]").waitFor({ state: "attached", timeout: 60_000 })
    const pieces = Number(await page.locator("#chat-output .assistant").getAttribute("data-pieces"))
    const seen = await page.evaluate(() => (window as unknown as { seen: Array<number> }).seen)
    const growth = new Set(seen.filter((length) => length > 0))
    assert.isAbove(pieces, 1, "the answer came in several pieces")
    assert.isAbove(growth.size, 1, `the answer grew as it streamed: ${JSON.stringify(seen)}`)
    assert.isAbove((await page.locator("#chat-output .assistant").textContent())?.trim().length ?? 0, 0)
    // the live figures counted it
    await page.waitForFunction(() => document.querySelector("#live-completed b")?.textContent !== "0", undefined, {
      timeout: 10_000
    })
    mkdirSync(artifacts, { recursive: true })
    await page.screenshot({ path: join(artifacts, "console.png"), fullPage: true })
    assert.isTrue(existsSync(join(artifacts, "console.png")))
    assert.deepStrictEqual(problems, [])
  })

  it("a node killed turns lost on the page, then the pool serves on the other: the plan moves there, a chat answers", async () => {
    const page = await browser.newPage({ viewport: { width: 1100, height: 1000 } })
    await page.goto(`${server.url}/`)
    await page.locator("#key-input").fill(key)
    await page.locator("#key-send").click()
    await page.locator("#nodes tbody tr[data-state=ready]").nth(1).waitFor({ timeout: 20_000 })
    const agents = await agentsOf(server.url, { authorization: `Bearer ${key}` })
    assert.strictEqual(agents.length, 2)
    const [survivor, killed] = agents as [(typeof agents)[number], (typeof agents)[number]]
    process.kill(killed.pid, "SIGKILL")
    await page
      .locator(`#nodes tbody tr[data-state=lost][data-address="${killed.address}"]`)
      .waitFor({ timeout: 20_000 })
    await page.locator("#chat-input").fill("Once upon a time")
    await page.locator("#chat-send").click()
    await page.locator("#chat-output .assistant[data-done=true]").waitFor({ state: "attached", timeout: 60_000 })
    assert.isAbove(Number(await page.locator("#chat-output .assistant").getAttribute("data-pieces")), 1)
    // the next run was planned on the survivor alone, and the page shows it
    await page.waitForFunction(
      (address) => {
        const rows = [...document.querySelectorAll("#plan tbody tr")]
        return rows.length > 0 && rows.every((r) => r.querySelectorAll("td")[2]?.textContent === address)
      },
      survivor.address,
      { timeout: 20_000 }
    )
    assert.strictEqual(
      await page.locator(`#nodes tbody tr[data-address="${survivor.address}"]`).getAttribute("data-state"),
      "ready"
    )
    assert.strictEqual(await page.locator("#server-status").textContent(), "server ready")
    await page.screenshot({ path: join(artifacts, "console-node-lost.png"), fullPage: true })
  })
})
