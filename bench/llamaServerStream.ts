/** llama-server's streamed `/completion` responses, read by bench:serve and bench:memory. */

/** One streamed event's payload (the fields the benches read). */
export interface CompletionEvent {
  readonly content?: string
  readonly stop?: boolean
}

/** Calls `onToken` for every token event of a streamed `/completion` response (the closing `stop` event left out). */
export const forEachStreamedToken = async (
  response: Response,
  onToken: (event: CompletionEvent) => void
): Promise<void> => {
  let buffer = ""
  const decoder = new TextDecoder()
  const reader = response.body!.getReader()
  for (;;) {
    const { done, value } = await reader.read()
    if (done) break
    buffer += decoder.decode(value, { stream: true })
    let at: number
    while ((at = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, at)
      buffer = buffer.slice(at + 2)
      if (!event.startsWith("data: ")) continue
      const data = JSON.parse(event.slice(6)) as CompletionEvent
      if (data.stop !== true) onToken(data)
    }
  }
}
