// A concurrent user, in a process of its own (test/support/abuse.ts watchStreams): greedy streams one after another
// against `swactor serve` until stdin closes, then one JSON line: the gaps between tokens within streams (largest,
// median), the streams' texts, errors, and connections refused before an answer (retried).
// Usage: node watchStreams.mjs URL PROMPT MAX_TOKENS
const [url, prompt, maxTokens] = process.argv.slice(2)
let stopped = false
process.stdin.on("end", () => (stopped = true))
process.stdin.resume()
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))
const gaps = []
const texts = []
const errors = []
let refusedConnections = 0
let announced = false
while (!stopped) {
  let answered = false
  try {
    const response = await fetch(`${url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt, max_tokens: Number(maxTokens), temperature: 0, stream: true })
    })
    answered = true
    if (response.status !== 200) {
      errors.push(`status ${response.status}: ${(await response.text()).slice(0, 300)}`)
      await sleep(100)
      continue
    }
    const reader = response.body.getReader()
    const decoder = new TextDecoder()
    let buffer = ""
    let text = ""
    let last
    for (;;) {
      const { done, value } = await reader.read()
      if (done) break
      buffer += decoder.decode(value, { stream: true })
      let end = buffer.indexOf("\n\n")
      while (end >= 0) {
        const line = buffer.slice(0, end)
        buffer = buffer.slice(end + 2)
        end = buffer.indexOf("\n\n")
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue
        const data = JSON.parse(line.slice(6))
        if (data.error !== undefined) errors.push(data.error.message)
        const piece = data.choices?.[0]?.text ?? ""
        if (piece === "") continue
        const now = performance.now()
        if (last !== undefined) gaps.push(now - last)
        last = now
        text += piece
        if (!announced && gaps.length >= 3) {
          announced = true
          process.stdout.write("started\n")
        }
      }
    }
    texts.push(text)
  } catch (error) {
    const code = error?.cause?.code
    if (!answered && (code === "ECONNRESET" || code === "ECONNREFUSED" || code === "UND_ERR_SOCKET"))
      refusedConnections++
    else errors.push(`${String(error)} ${String(error?.cause)}`)
    await sleep(50)
  }
}
const sorted = [...gaps].sort((a, b) => a - b)
process.stdout.write(
  `${JSON.stringify({
    maxGapMillis: sorted.at(-1) ?? 0,
    medianGapMillis: sorted[Math.floor(sorted.length / 2)] ?? 0,
    tokens: gaps.length,
    texts,
    errors,
    refusedConnections
  })}\n`
)
