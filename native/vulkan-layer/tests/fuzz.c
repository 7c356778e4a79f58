/* Fuzz targets for what the layer parses from outside: GPUPPETTI_VK_SLICES, GPUPPETTI_VK_COMPUTE, and the ledger's
 * answer to HELLO with the header of the shared page it hands over (which every process of the allocation can
 * write). Built with AddressSanitizer and UBSan (make fuzz).
 *
 * With clang, libFuzzer drives LLVMFuzzerTestOneInput, coverage-guided. Without it, the main below does: random
 * mutations of a few valid inputs, for a bounded time (FUZZ_SECONDS, default 10), with a fixed seed per run
 * printed so that a failure can be replayed (FUZZ_SEED).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../ledger.h"
#include "../slices.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static __attribute__((unused)) char *as_text(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (text != NULL) {
        memcpy(text, data, size);
        text[size] = '\0';
    }
    return text;
}

#if defined(FUZZ_SLICES)
/* Any text: parses or not; what parses names budgets and selectors, and the compute shares then fit it. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = as_text(data, size);
    if (text == NULL) return 0;
    struct slices slices;
    if (slices_parse(text, &slices)) {
        if (slices.count < 1 || slices.items == NULL) abort();
        for (int i = 0; i < slices.count; i++) {
            if (slices.items[i].budget < 0 || slices.items[i].compute != 1000) abort();
        }
        slices_free(&slices);
    } else if (slices.items != NULL || slices.count != 0 || slices.active) {
        abort();
    }
    free(text);
    return 0;
}
#elif defined(FUZZ_COMPUTE)
/* Any text against one to four slices: every share ends within 1..1000, all of them 1000 where it does not parse. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    char *text = as_text(data + 1, size - 1);
    if (text == NULL) return 0;
    struct slice items[4];
    memset(items, 0, sizeof items);
    struct slices slices = {.active = true, .count = 1 + data[0] % 4, .items = items};
    bool parsed = slices_parse_compute(text, &slices);
    for (int i = 0; i < slices.count; i++) {
        if (items[i].compute < 1 || items[i].compute > 1000 || (!parsed && items[i].compute != 1000)) abort();
    }
    free(text);
    return 0;
}
#elif defined(FUZZ_HELLO)
/* Any answer and page header, for one to eight slices: what parses has as many terms as slices, each budget >= 0 and
 * each share within 0..1000; nothing is read past what was given. The input: the slice count, how long the answer
 * is (as long as it should be, or a length of the input's), how large the page is, the answer, the page's start. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3) return 0;
    int slices = 1 + data[0] % 8;
    size_t expected = sizeof(struct ledger_answer) + (size_t)slices * sizeof(struct ledger_slice_terms);
    size_t available = size - 3;
    size_t length = data[1] % 2 == 0 ? expected : (size_t)data[1] / 2;
    if (length > available) length = available;
    int64_t page_size = data[2] % 4 == 0 ? LEDGER_SHARED_SIZE - 1 - data[2] : LEDGER_SHARED_SIZE;
    /* Exactly as long as given, so that AddressSanitizer sees a read past it. */
    uint8_t *answer = malloc(length ? length : 1);
    struct ledger_shared *page = calloc(1, LEDGER_SHARED_SIZE);
    if (answer == NULL || page == NULL) abort();
    memcpy(answer, data + 3, length);
    size_t header = available - length < 64 ? available - length : 64;
    memcpy(page, data + 3 + length, header);
    struct ledger_terms terms;
    if (ledger_parse_hello(answer, length, page, page_size, slices, &terms)) {
        if (terms.count != slices || length != expected || page_size < LEDGER_SHARED_SIZE) abort();
        for (int i = 0; i < slices; i++) {
            if (terms.budget[i] < 0 || terms.compute[i] < 0 || terms.compute[i] > 1000) abort();
        }
    }
    free(answer);
    free(page);
    return 0;
}
#else
#error "define FUZZ_SLICES, FUZZ_COMPUTE or FUZZ_HELLO"
#endif

#ifndef LIBFUZZER
/* A plain driver where libFuzzer is not at hand: mutations of seeds, for FUZZ_SECONDS. */
#define SEED(text) {text, sizeof text - 1}
static const struct {
    const char *data;
    size_t size;
} seeds[] = {
    SEED("any=268435456"), SEED("pci:0000:03:00.0=1073741824,uuid:GPU-8b2e4c1a-0000-0000-0000-000000000000=0"),
    SEED("250,500"), SEED("1000"), SEED("uuid:8b2e4c1a8b2e4c1a8b2e4c1a8b2e4c1a=1"),
    /* HELLO's answer for one slice (OK, one slice, a page of 20480 bytes; 256 MiB and a share of 250), and the
     * page's header. */
    SEED("\0\0\x01" "\0\0\0\0\x01\0\0\0\0\x50\0\0\0\0\0\0" "\0\0\0\x10\0\0\0\0\xfa\0\0\0\0\0\0\0"
         "GPPTLD01\x01\0\0\0\x01\0\0\0"),
};

static uint64_t state;

static uint64_t next_random(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

int main(void)
{
    const char *seconds_text = getenv("FUZZ_SECONDS");
    const char *seed_text = getenv("FUZZ_SEED");
    long seconds = seconds_text != NULL ? strtol(seconds_text, NULL, 10) : 10;
    state = seed_text != NULL ? strtoull(seed_text, NULL, 10) : (uint64_t)time(NULL);
    printf("fuzzing for %ld s, FUZZ_SEED=%llu\n", seconds, (unsigned long long)state);
    state |= 1;
    time_t end = time(NULL) + seconds;
    uint8_t buffer[4096];
    unsigned long runs = 0;
    while (time(NULL) < end) {
        for (int batch = 0; batch < 256; batch++, runs++) {
            size_t pick = next_random() % (sizeof seeds / sizeof *seeds);
            size_t size = seeds[pick].size;
            memcpy(buffer, seeds[pick].data, size);
            int edits = 1 + (int)(next_random() % 8);
            for (int e = 0; e < edits; e++) {
                size_t at = size > 0 ? next_random() % size : 0;
                switch (next_random() % 5) {
                case 0: buffer[at] = (uint8_t)next_random(); break;
                case 1: buffer[at] = (uint8_t)",=:-.0123456789abcdefGPU"[next_random() % 24]; break;
                case 2: size = at; break;
                case 3:
                    if (size < sizeof buffer - 1) {
                        memmove(buffer + at + 1, buffer + at, size - at);
                        buffer[at] = (uint8_t)",=9"[next_random() % 3];
                        size++;
                    }
                    break;
                default:
                    if (size * 2 < sizeof buffer) {
                        memcpy(buffer + size, buffer, size);
                        size *= 2;
                    }
                }
            }
            LLVMFuzzerTestOneInput(buffer, size);
        }
    }
    printf("%lu inputs, no failure\n", runs);
    return 0;
}
#endif
