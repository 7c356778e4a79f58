/* gpuppetti-vkinfo: what a container sees of its GPUs through Vulkan, and what it can obtain.
 *
 *   gpuppetti-vkinfo                      the devices, their heaps, budgets and usage, and whether the layer is on
 *   gpuppetti-vkinfo --json               the same as JSON, with each device's driver (VK_KHR_driver_properties),
 *                                         ids, PCI bus address (VK_EXT_pci_bus_info) and DRM nodes
 *                                         (VK_EXT_physical_device_drm) where the driver reports them: what
 *                                         `gpuppetti doctor` matches to each GPU's render node
 *   gpuppetti-vkinfo --allocate MIB       allocate MIB-sized chunks of the first device's memory until refused
 *                    [--limit MIB]        and stop once that much is obtained
 *                    [--threads N]        from N threads at once
 *                    [--hold SECONDS]     and keep them that long before exiting
 *   gpuppetti-vkinfo --bench N            time N vkAllocateMemory and vkFreeMemory calls of 4 KiB (nanoseconds)
 *   gpuppetti-vkinfo --busy SECONDS       keep the first device busy that long, filling a buffer again and again,
 *                    [--fill MIB]         of MIB (default 64)
 *                    [--in-flight N]      with N batches queued at once (default 1), and print the batches done
 *                                         and the GPU time they took (from timestamps written around each fill)
 *   gpuppetti-vkinfo --queue N            submit N such batches at once without waiting for any [--fill MIB], then
 *                                         one more once they have run: print their GPU time, the wall time they
 *                                         took, and how long that next submit waited
 *
 * It is shipped with the layer and mounted into every container that gets a slice. Exit codes: 0, 1 when Vulkan
 * cannot be used here, 2 for a bad option.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <vulkan/vulkan.h>

#define LAYER_LIBRARY "libVkLayer_gpuppetti.so"
#define MAX_THREADS 256
#define MAX_CHUNKS 65536

struct options {
    bool json;
    long allocate_mib;
    long limit_mib;
    int threads;
    long hold_seconds;
    long bench;
    long busy_seconds;
    long fill_mib;
    int in_flight;
    long queue;
};

static const char help[] =
    "usage: gpuppetti-vkinfo [--json] [--allocate MIB [--limit MIB] [--threads N] [--hold SECONDS]]\n"
    "                        [--bench N] [--busy SECONDS [--fill MIB] [--in-flight N]] [--queue N [--fill MIB]]\n"
    "\n"
    "What this process sees of its GPUs through Vulkan (devices, heaps, budgets, whether gpuppetti's layer is\n"
    "loaded), and what it can obtain.\n"
    "\n"
    "  --json              print the report as JSON\n"
    "  --allocate MIB      allocate MIB-sized chunks of the first device's memory until refused\n"
    "  --limit MIB         ... and stop once that much is obtained\n"
    "  --threads N         ... from N threads at once\n"
    "  --hold SECONDS      ... and keep them that long before exiting\n"
    "  --bench N           time N vkAllocateMemory and vkFreeMemory calls of 4 KiB (nanoseconds)\n"
    "  --busy SECONDS      keep the first device busy that long, and print the batches done and their GPU time\n"
    "  --fill MIB          ... filling a buffer of MIB (default 64)\n"
    "  --in-flight N       ... with N batches queued at once (default 1)\n"
    "  --queue N           submit N batches of buffer fills at once without waiting, then one more once they have\n"
    "                      run: print their GPU time, the wall time they took and how long that submit waited\n"
    "  -h, --help          show this help\n"
    "\n"
    "Exit codes: 0, 1 when Vulkan cannot be used here, 2 for a bad option.\n";

static int usage(const char *problem)
{
    fprintf(stderr, "gpuppetti-vkinfo: %s (options: --json, --allocate MIB [--limit MIB] [--threads N] "
                    "[--hold SECONDS], --bench N, --busy SECONDS [--fill MIB] [--in-flight N], "
                    "--queue N [--fill MIB])\n", problem);
    return 2;
}

static bool number(const char *text, long low, long high, long *out)
{
    char *end = NULL;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || value < low || value > high) {
        return false;
    }
    *out = value;
    return true;
}

static const char *result_name(VkResult result)
{
    switch (result) {
    case VK_SUCCESS: return "VK_SUCCESS";
    case VK_ERROR_OUT_OF_DEVICE_MEMORY: return "VK_ERROR_OUT_OF_DEVICE_MEMORY";
    case VK_ERROR_OUT_OF_HOST_MEMORY: return "VK_ERROR_OUT_OF_HOST_MEMORY";
    case VK_ERROR_INITIALIZATION_FAILED: return "VK_ERROR_INITIALIZATION_FAILED";
    case VK_ERROR_INCOMPATIBLE_DRIVER: return "VK_ERROR_INCOMPATIBLE_DRIVER";
    case VK_ERROR_EXTENSION_NOT_PRESENT: return "VK_ERROR_EXTENSION_NOT_PRESENT";
    case VK_ERROR_TOO_MANY_OBJECTS: return "VK_ERROR_TOO_MANY_OBJECTS";
    default: return "VK_ERROR_OTHER";
    }
}

static const char *type_name(VkPhysicalDeviceType type)
{
    switch (type) {
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return "integrated";
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return "discrete";
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return "virtual";
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return "cpu";
    default: return "other";
    }
}

/* Whether the layer is active in this process: the loader loads an implicit layer's library only when it is
 * enabled (its disable_environment unset), so its presence in the process's mappings tells. */
static bool layer_loaded(void)
{
    FILE *maps = fopen("/proc/self/maps", "r");
    if (maps == NULL) {
        return false;
    }
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, maps) != NULL) {
        found = strstr(line, LAYER_LIBRARY) != NULL;
    }
    fclose(maps);
    return found;
}

static bool device_has(VkPhysicalDevice physical, const char *name)
{
    uint32_t count = 0;
    if (vkEnumerateDeviceExtensionProperties(physical, NULL, &count, NULL) != VK_SUCCESS || count == 0) {
        return false;
    }
    VkExtensionProperties *extensions = calloc(count, sizeof *extensions);
    bool found = false;
    if (extensions != NULL && vkEnumerateDeviceExtensionProperties(physical, NULL, &count, extensions) >= 0) {
        for (uint32_t i = 0; i < count && !found; i++) {
            found = strcmp(extensions[i].extensionName, name) == 0;
        }
    }
    free(extensions);
    return found;
}

struct heap_view {
    VkDeviceSize size, budget, usage;
    bool local;
};

struct device_view {
    VkPhysicalDeviceProperties properties;
    uint8_t uuid[VK_UUID_SIZE];
    bool has_budget;
    VkDeviceSize max_allocation;
    uint32_t heap_count;
    struct heap_view heaps[VK_MAX_MEMORY_HEAPS];
    /* Which driver serves the device, and where it sits: each only where the driver has the extension. */
    bool has_driver;
    VkPhysicalDeviceDriverPropertiesKHR driver;
    bool has_pci;
    VkPhysicalDevicePCIBusInfoPropertiesEXT pci;
    bool has_drm;
    VkPhysicalDeviceDrmPropertiesEXT drm;
};

static void view_device(VkPhysicalDevice physical, struct device_view *view)
{
    memset(view, 0, sizeof *view);
    VkPhysicalDeviceMaintenance3Properties maintenance3 = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES};
    VkPhysicalDeviceIDProperties id = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES, .pNext = &maintenance3};
    /* A structure goes into the chain only where the device has its extension: the instance asks for Vulkan 1.1. */
    view->driver.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES_KHR;
    view->pci.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT;
    view->drm.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRM_PROPERTIES_EXT;
    view->has_driver = device_has(physical, VK_KHR_DRIVER_PROPERTIES_EXTENSION_NAME);
    view->has_pci = device_has(physical, VK_EXT_PCI_BUS_INFO_EXTENSION_NAME);
    view->has_drm = device_has(physical, VK_EXT_PHYSICAL_DEVICE_DRM_EXTENSION_NAME);
    if (view->has_driver) {
        view->driver.pNext = id.pNext;
        id.pNext = &view->driver;
    }
    if (view->has_pci) {
        view->pci.pNext = id.pNext;
        id.pNext = &view->pci;
    }
    if (view->has_drm) {
        view->drm.pNext = id.pNext;
        id.pNext = &view->drm;
    }
    VkPhysicalDeviceProperties2 properties = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &id};
    vkGetPhysicalDeviceProperties2(physical, &properties);
    /* Only the structures' own fields are read later: their chain pointed at locals of this function. */
    view->driver.pNext = NULL;
    view->pci.pNext = NULL;
    view->drm.pNext = NULL;
    view->properties = properties.properties;
    memcpy(view->uuid, id.deviceUUID, VK_UUID_SIZE);
    view->max_allocation = maintenance3.maxMemoryAllocationSize;
    view->has_budget = device_has(physical, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME);
    VkPhysicalDeviceMemoryBudgetPropertiesEXT budget = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT};
    VkPhysicalDeviceMemoryProperties2 memory = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                                                .pNext = view->has_budget ? &budget : NULL};
    vkGetPhysicalDeviceMemoryProperties2(physical, &memory);
    view->heap_count = memory.memoryProperties.memoryHeapCount;
    for (uint32_t i = 0; i < view->heap_count; i++) {
        view->heaps[i].size = memory.memoryProperties.memoryHeaps[i].size;
        view->heaps[i].local = (memory.memoryProperties.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) != 0;
        view->heaps[i].budget = view->has_budget ? budget.heapBudget[i] : 0;
        view->heaps[i].usage = view->has_budget ? budget.heapUsage[i] : 0;
    }
}

static void print_uuid(FILE *out, const uint8_t *uuid)
{
    for (unsigned i = 0; i < VK_UUID_SIZE; i++) {
        fprintf(out, "%02x", uuid[i]);
    }
}

static void print_json_string(const char *text)
{
    putchar('"');
    for (const unsigned char *c = (const unsigned char *)text; *c != '\0'; c++) {
        if (*c == '"' || *c == '\\') {
            printf("\\%c", *c);
        } else if (*c < 0x20) {
            printf("\\u%04x", *c);
        } else {
            putchar(*c);
        }
    }
    putchar('"');
}

static void print_version(uint32_t version)
{
    printf("%u.%u.%u", VK_API_VERSION_MAJOR(version), VK_API_VERSION_MINOR(version), VK_API_VERSION_PATCH(version));
}

/* The driver that serves the device, its ids, and where it sits (PCI bus address, DRM nodes), as JSON members. */
static void print_json_where(const struct device_view *view)
{
    printf("\"vendor_id\": %u, \"device_id\": %u, \"api_version\": \"", view->properties.vendorID,
           view->properties.deviceID);
    print_version(view->properties.apiVersion);
    printf("\", \"driver\": ");
    if (view->has_driver) {
        printf("{\"id\": %d, \"name\": ", (int)view->driver.driverID);
        print_json_string(view->driver.driverName);
        printf(", \"info\": ");
        print_json_string(view->driver.driverInfo);
        printf("}");
    } else {
        printf("null");
    }
    printf(", \"pci_bus\": ");
    if (view->has_pci) {
        printf("\"%04x:%02x:%02x.%x\"", view->pci.pciDomain, view->pci.pciBus, view->pci.pciDevice,
               view->pci.pciFunction);
    } else {
        printf("null");
    }
    printf(", \"drm\": ");
    if (view->has_drm) {
        printf("{\"primary\": ");
        if (view->drm.hasPrimary) {
            printf("\"%lld:%lld\"", (long long)view->drm.primaryMajor, (long long)view->drm.primaryMinor);
        } else {
            printf("null");
        }
        printf(", \"render\": ");
        if (view->drm.hasRender) {
            printf("\"%lld:%lld\"", (long long)view->drm.renderMajor, (long long)view->drm.renderMinor);
        } else {
            printf("null");
        }
        printf("}");
    } else {
        printf("null");
    }
}

static void print_text_where(const struct device_view *view)
{
    printf("  driver: ");
    if (view->has_driver) {
        printf("%s (%s)", view->driver.driverName, view->driver.driverInfo);
    } else {
        printf("unknown");
    }
    printf(", ids %04x:%04x, Vulkan ", view->properties.vendorID, view->properties.deviceID);
    print_version(view->properties.apiVersion);
    if (view->has_pci) {
        printf(", PCI %04x:%02x:%02x.%x", view->pci.pciDomain, view->pci.pciBus, view->pci.pciDevice,
               view->pci.pciFunction);
    }
    if (view->has_drm && view->drm.hasRender) {
        printf(", render node %lld:%lld", (long long)view->drm.renderMajor, (long long)view->drm.renderMinor);
    }
    printf("\n");
}

static void report(bool json, bool layer, VkPhysicalDevice *physicals, uint32_t count)
{
    const char *slices = getenv("GPUPPETTI_VK_SLICES");
    const char *compute = getenv("GPUPPETTI_VK_COMPUTE");
    if (json) {
        printf("{\"layer\": %s, \"slices\": ", layer ? "true" : "false");
        if (slices != NULL) {
            print_json_string(slices);
        } else {
            printf("null");
        }
        printf(", \"compute\": ");
        if (compute != NULL) {
            print_json_string(compute);
        } else {
            printf("null");
        }
        printf(", \"devices\": [");
    } else {
        printf("slice layer (VK_LAYER_GPUPPETTI_slice): %s (GPUPPETTI_VK_SLICES=%s", layer ? "loaded" : "not loaded",
               slices != NULL ? slices : "unset");
        if (compute != NULL) {
            printf(", GPUPPETTI_VK_COMPUTE=%s", compute);
        }
        printf(")\n");
    }
    for (uint32_t d = 0; d < count; d++) {
        struct device_view view;
        view_device(physicals[d], &view);
        if (json) {
            printf("%s{\"name\": ", d ? ", " : "");
            print_json_string(view.properties.deviceName);
            printf(", \"type\": \"%s\", \"uuid\": \"", type_name(view.properties.deviceType));
            print_uuid(stdout, view.uuid);
            printf("\", \"memory_budget\": %s, \"max_allocation\": %llu, ", view.has_budget ? "true" : "false",
                   (unsigned long long)view.max_allocation);
            print_json_where(&view);
            printf(", \"heaps\": [");
            for (uint32_t h = 0; h < view.heap_count; h++) {
                printf("%s{\"size\": %llu, \"device_local\": %s, \"budget\": %llu, \"usage\": %llu}", h ? ", " : "",
                       (unsigned long long)view.heaps[h].size, view.heaps[h].local ? "true" : "false",
                       (unsigned long long)view.heaps[h].budget, (unsigned long long)view.heaps[h].usage);
            }
            printf("]}");
        } else {
            printf("device %u: %s (%s), uuid ", d, view.properties.deviceName, type_name(view.properties.deviceType));
            print_uuid(stdout, view.uuid);
            printf(", largest allocation %llu MiB\n", (unsigned long long)(view.max_allocation >> 20));
            print_text_where(&view);
            for (uint32_t h = 0; h < view.heap_count; h++) {
                printf("  heap %u: %llu MiB%s", h, (unsigned long long)(view.heaps[h].size >> 20),
                       view.heaps[h].local ? ", device-local" : "");
                if (view.has_budget) {
                    printf(", budget %llu MiB, in use %llu MiB", (unsigned long long)(view.heaps[h].budget >> 20),
                           (unsigned long long)(view.heaps[h].usage >> 20));
                }
                printf("\n");
            }
        }
    }
    if (json) {
        printf("]");
    }
}

/* -- allocating until refused, from one thread or many ---------------------------------------------------- */

struct allocator {
    VkDevice device;
    uint32_t type;
    VkDeviceSize chunk;
    long limit; /* bytes; 0: until refused */
    atomic_long obtained;
    atomic_int chunks;
    VkDeviceMemory *memories;
    atomic_int refusal;
};

static void *allocate_until_refused(void *argument)
{
    struct allocator *allocator = argument;
    for (;;) {
        if (allocator->limit > 0 &&
            atomic_fetch_add(&allocator->obtained, (long)allocator->chunk) + (long)allocator->chunk >
                allocator->limit) {
            atomic_fetch_sub(&allocator->obtained, (long)allocator->chunk);
            return NULL;
        }
        VkMemoryAllocateInfo info = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                     .allocationSize = allocator->chunk, .memoryTypeIndex = allocator->type};
        VkDeviceMemory memory = VK_NULL_HANDLE;
        VkResult result = vkAllocateMemory(allocator->device, &info, NULL, &memory);
        if (result != VK_SUCCESS) {
            if (allocator->limit > 0) {
                atomic_fetch_sub(&allocator->obtained, (long)allocator->chunk);
            }
            atomic_store(&allocator->refusal, (int)result);
            return NULL;
        }
        int slot = atomic_fetch_add(&allocator->chunks, 1);
        if (slot >= MAX_CHUNKS) {
            vkFreeMemory(allocator->device, memory, NULL);
            atomic_store(&allocator->refusal, (int)VK_ERROR_TOO_MANY_OBJECTS);
            return NULL;
        }
        allocator->memories[slot] = memory;
        if (allocator->limit == 0) {
            atomic_fetch_add(&allocator->obtained, (long)allocator->chunk);
        }
    }
}

/* The first device-local memory type (the first type where none is), and its heap. */
static uint32_t memory_type(VkPhysicalDevice physical, uint32_t *heap)
{
    VkPhysicalDeviceMemoryProperties memory;
    vkGetPhysicalDeviceMemoryProperties(physical, &memory);
    uint32_t chosen = 0;
    for (uint32_t i = 0; i < memory.memoryTypeCount; i++) {
        if (memory.memoryTypes[i].propertyFlags & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT) {
            chosen = i;
            break;
        }
    }
    *heap = memory.memoryTypes[chosen].heapIndex;
    return chosen;
}

static VkDevice make_device(VkPhysicalDevice physical)
{
    float priority = 1.0f;
    VkDeviceQueueCreateInfo queue = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, .queueFamilyIndex = 0,
                                     .queueCount = 1, .pQueuePriorities = &priority};
    VkDeviceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, .queueCreateInfoCount = 1,
                               .pQueueCreateInfos = &queue};
    VkDevice device = VK_NULL_HANDLE;
    if (vkCreateDevice(physical, &info, NULL, &device) != VK_SUCCESS) {
        return VK_NULL_HANDLE;
    }
    return device;
}

static int allocate(const struct options *options, VkPhysicalDevice physical)
{
    VkDevice device = make_device(physical);
    if (device == VK_NULL_HANDLE) {
        fprintf(stderr, "gpuppetti-vkinfo: vkCreateDevice failed\n");
        return 1;
    }
    uint32_t heap = 0;
    struct allocator allocator = {.device = device, .type = memory_type(physical, &heap),
                                  .chunk = (VkDeviceSize)options->allocate_mib << 20,
                                  .limit = options->limit_mib << 20};
    allocator.memories = calloc(MAX_CHUNKS, sizeof *allocator.memories);
    if (allocator.memories == NULL) {
        return 1;
    }
    pthread_t threads[MAX_THREADS];
    int started = 0;
    for (int i = 0; i < options->threads; i++) {
        if (pthread_create(&threads[started], NULL, allocate_until_refused, &allocator) == 0) {
            started++;
        }
    }
    for (int i = 0; i < started; i++) {
        pthread_join(threads[i], NULL);
    }
    struct device_view view;
    view_device(physical, &view);
    long obtained = atomic_load(&allocator.obtained);
    if (options->json) {
        printf(", \"allocation\": {\"chunk\": %llu, \"threads\": %d, \"chunks\": %d, \"obtained\": %ld, "
               "\"refused_with\": \"%s\", \"heap_budget_after\": %llu, \"heap_usage_after\": %llu}",
               (unsigned long long)allocator.chunk, started, atomic_load(&allocator.chunks), obtained,
               result_name((VkResult)atomic_load(&allocator.refusal)), (unsigned long long)view.heaps[heap].budget,
               (unsigned long long)view.heaps[heap].usage);
    } else {
        printf("allocated %d chunk(s) of %ld MiB from %d thread(s): %ld MiB, then %s\n",
               atomic_load(&allocator.chunks), options->allocate_mib, started, obtained >> 20,
               result_name((VkResult)atomic_load(&allocator.refusal)));
    }
    fflush(stdout);
    if (options->hold_seconds > 0) {
        sleep((unsigned)options->hold_seconds);
    }
    for (int i = 0; i < atomic_load(&allocator.chunks) && i < MAX_CHUNKS; i++) {
        vkFreeMemory(device, allocator.memories[i], NULL);
    }
    free(allocator.memories);
    vkDestroyDevice(device, NULL);
    return 0;
}

/* -- the cost of the two calls the layer wraps -------------------------------------------------------------- */

static double now_ns(void)
{
    struct timespec time;
    clock_gettime(CLOCK_MONOTONIC, &time);
    return (double)time.tv_sec * 1e9 + (double)time.tv_nsec;
}

static int compare(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int bench(const struct options *options, VkPhysicalDevice physical)
{
    VkDevice device = make_device(physical);
    if (device == VK_NULL_HANDLE) {
        fprintf(stderr, "gpuppetti-vkinfo: vkCreateDevice failed\n");
        return 1;
    }
    long calls = options->bench;
    double *allocations = calloc((size_t)calls, sizeof *allocations);
    double *frees = calloc((size_t)calls, sizeof *frees);
    if (allocations == NULL || frees == NULL) {
        return 1;
    }
    VkMemoryAllocateInfo info = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, .allocationSize = 4096,
                                 .memoryTypeIndex = memory_type(physical, &(uint32_t){0})};
    for (long i = 0; i < calls; i++) {
        VkDeviceMemory memory;
        double began = now_ns();
        VkResult result = vkAllocateMemory(device, &info, NULL, &memory);
        double allocated = now_ns();
        if (result != VK_SUCCESS) {
            fprintf(stderr, "gpuppetti-vkinfo: vkAllocateMemory: %s\n", result_name(result));
            return 1;
        }
        vkFreeMemory(device, memory, NULL);
        double freed = now_ns();
        allocations[i] = allocated - began;
        frees[i] = freed - allocated;
    }
    qsort(allocations, (size_t)calls, sizeof *allocations, compare);
    qsort(frees, (size_t)calls, sizeof *frees, compare);
    printf("{\"calls\": %ld, \"allocate_ns\": {\"p50\": %.0f, \"p99\": %.0f}, \"free_ns\": {\"p50\": %.0f, "
           "\"p99\": %.0f}}\n", calls, allocations[calls / 2], allocations[calls * 99 / 100], frees[calls / 2],
           frees[calls * 99 / 100]);
    free(allocations);
    free(frees);
    vkDestroyDevice(device, NULL);
    return 0;
}

/* -- GPU time: batches of work, to see a compute share hold ------------------------------------------------- */

#define MAX_IN_FLIGHT 128
#define MAX_QUEUED 65536

/* Batches that each fill a buffer, with a timestamp written before and after the fill. Each batch's command buffer
 * also copies its two timestamps into memory the host reads once the batch's fence has signalled: reading them
 * with vkGetQueryPoolResults would not do, since lavapipe's waits for the whole device and so would keep no more
 * than one batch in flight. */
struct batches {
    VkDevice device;
    VkQueue queue;
    VkDeviceSize size;
    int count;
    VkBuffer buffer, stamps;
    VkDeviceMemory memory, stamps_memory;
    volatile uint64_t *stamp;  /* two per batch, mapped */
    VkCommandPool pool;
    VkCommandBuffer *commands;
    VkQueryPool queries;
    double period;             /* ns per timestamp tick */
};

static uint32_t memory_type_with(VkPhysicalDevice physical, uint32_t allowed, VkMemoryPropertyFlags flags)
{
    VkPhysicalDeviceMemoryProperties properties;
    vkGetPhysicalDeviceMemoryProperties(physical, &properties);
    for (uint32_t type = 0; type < properties.memoryTypeCount; type++) {
        if ((allowed & (1u << type)) && (properties.memoryTypes[type].propertyFlags & flags) == flags) {
            return type;
        }
    }
    return UINT32_MAX;
}

static bool buffer_with_memory(struct batches *work, VkPhysicalDevice physical, VkDeviceSize size,
                               VkMemoryPropertyFlags flags, VkBuffer *buffer, VkDeviceMemory *memory)
{
    VkBufferCreateInfo info = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = size,
                               .usage = VK_BUFFER_USAGE_TRANSFER_DST_BIT};
    if (vkCreateBuffer(work->device, &info, NULL, buffer) != VK_SUCCESS) {
        fprintf(stderr, "gpuppetti-vkinfo: vkCreateBuffer failed\n");
        return false;
    }
    VkMemoryRequirements needs;
    vkGetBufferMemoryRequirements(work->device, *buffer, &needs);
    uint32_t type = memory_type_with(physical, needs.memoryTypeBits, flags);
    if (type == UINT32_MAX) {
        fprintf(stderr, "gpuppetti-vkinfo: no memory type for a buffer of %llu bytes\n", (unsigned long long)size);
        return false;
    }
    VkMemoryAllocateInfo allocation = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                       .allocationSize = needs.size, .memoryTypeIndex = type};
    VkResult result = vkAllocateMemory(work->device, &allocation, NULL, memory);
    if (result != VK_SUCCESS) {
        fprintf(stderr, "gpuppetti-vkinfo: vkAllocateMemory of %llu bytes: %s\n", (unsigned long long)needs.size,
                result_name(result));
        return false;
    }
    vkBindBufferMemory(work->device, *buffer, *memory, 0);
    return true;
}

static bool batches_make(struct batches *work, VkPhysicalDevice physical, long fill_mib, int count)
{
    memset(work, 0, sizeof *work);
    work->device = make_device(physical);
    if (work->device == VK_NULL_HANDLE) {
        fprintf(stderr, "gpuppetti-vkinfo: vkCreateDevice failed\n");
        return false;
    }
    vkGetDeviceQueue(work->device, 0, 0, &work->queue);
    work->size = (VkDeviceSize)fill_mib << 20;
    work->count = count;
    if (!buffer_with_memory(work, physical, work->size, 0, &work->buffer, &work->memory) ||
        !buffer_with_memory(work, physical, 16 * (VkDeviceSize)count,
                            VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
                            &work->stamps, &work->stamps_memory)) {
        return false;
    }
    void *mapped = NULL;
    if (vkMapMemory(work->device, work->stamps_memory, 0, VK_WHOLE_SIZE, 0, &mapped) != VK_SUCCESS) {
        fprintf(stderr, "gpuppetti-vkinfo: vkMapMemory failed\n");
        return false;
    }
    work->stamp = mapped;
    VkCommandPoolCreateInfo pool_info = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, .queueFamilyIndex = 0};
    vkCreateCommandPool(work->device, &pool_info, NULL, &work->pool);
    work->commands = calloc((size_t)count, sizeof *work->commands);
    VkCommandBufferAllocateInfo command_info = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                                                .commandPool = work->pool, .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                                .commandBufferCount = (uint32_t)count};
    if (work->commands == NULL || vkAllocateCommandBuffers(work->device, &command_info, work->commands) != VK_SUCCESS) {
        fprintf(stderr, "gpuppetti-vkinfo: vkAllocateCommandBuffers of %d failed\n", count);
        return false;
    }
    VkQueryPoolCreateInfo query_info = {.sType = VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                                        .queryType = VK_QUERY_TYPE_TIMESTAMP, .queryCount = 2 * (uint32_t)count};
    if (vkCreateQueryPool(work->device, &query_info, NULL, &work->queries) != VK_SUCCESS) {
        fprintf(stderr, "gpuppetti-vkinfo: vkCreateQueryPool failed\n");
        return false;
    }
    VkPhysicalDeviceProperties properties;
    vkGetPhysicalDeviceProperties(physical, &properties);
    work->period = (double)properties.limits.timestampPeriod;
    for (int i = 0; i < count; i++) {
        VkCommandBuffer commands = work->commands[i];
        uint32_t first = 2 * (uint32_t)i;
        VkCommandBufferBeginInfo begin = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
        vkBeginCommandBuffer(commands, &begin);
        vkCmdResetQueryPool(commands, work->queries, first, 2);
        vkCmdWriteTimestamp(commands, VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, work->queries, first);
        vkCmdFillBuffer(commands, work->buffer, 0, VK_WHOLE_SIZE, 0x5a5a5a5a);
        vkCmdWriteTimestamp(commands, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, work->queries, first + 1);
        vkCmdCopyQueryPoolResults(commands, work->queries, first, 2, work->stamps, 16 * (VkDeviceSize)i, 8,
                                  VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT);
        VkMemoryBarrier visible = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                   .srcAccessMask = VK_ACCESS_TRANSFER_WRITE_BIT,
                                   .dstAccessMask = VK_ACCESS_HOST_READ_BIT};
        vkCmdPipelineBarrier(commands, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_PIPELINE_STAGE_HOST_BIT, 0, 1, &visible, 0,
                             NULL, 0, NULL);
        vkEndCommandBuffer(commands);
    }
    return true;
}

/* Batch i's GPU time (ns), once it has run; 0 where its timestamps do not say. */
static double batch_ns(const struct batches *work, int i)
{
    uint64_t start = work->stamp[2 * i], end = work->stamp[2 * i + 1];
    return end > start ? (double)(end - start) * work->period : 0.0;
}

static VkResult submit_batch(const struct batches *work, int i, VkFence fence)
{
    VkSubmitInfo submit = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .commandBufferCount = 1,
                           .pCommandBuffers = &work->commands[i]};
    return vkQueueSubmit(work->queue, 1, &submit, fence);
}

static void batches_free(struct batches *work)
{
    if (work->device == VK_NULL_HANDLE) {
        return;
    }
    vkDeviceWaitIdle(work->device);
    if (work->queries != VK_NULL_HANDLE) vkDestroyQueryPool(work->device, work->queries, NULL);
    if (work->pool != VK_NULL_HANDLE) vkDestroyCommandPool(work->device, work->pool, NULL);
    free(work->commands);
    if (work->buffer != VK_NULL_HANDLE) vkDestroyBuffer(work->device, work->buffer, NULL);
    if (work->memory != VK_NULL_HANDLE) vkFreeMemory(work->device, work->memory, NULL);
    if (work->stamps != VK_NULL_HANDLE) vkDestroyBuffer(work->device, work->stamps, NULL);
    if (work->stamps_memory != VK_NULL_HANDLE) vkFreeMemory(work->device, work->stamps_memory, NULL);
    vkDestroyDevice(work->device, NULL);
}

/* --busy: batches for that long, N in flight, each submitted once the one N before it is done. */
static int busy(const struct options *options, VkPhysicalDevice physical)
{
    struct batches work;
    if (!batches_make(&work, physical, options->fill_mib, options->in_flight)) {
        batches_free(&work);
        return 1;
    }
    VkFence fences[MAX_IN_FLIGHT];
    bool pending[MAX_IN_FLIGHT] = {false};
    VkFenceCreateInfo fence_info = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
    for (int i = 0; i < options->in_flight; i++) {
        vkCreateFence(work.device, &fence_info, NULL, &fences[i]);
    }
    double began = now_ns(), until = began + (double)options->busy_seconds * 1e9;
    double gpu_ns = 0;
    long done = 0;
    int slot = 0;
    int code = 0;
    while (now_ns() < until) {
        if (pending[slot]) {
            vkWaitForFences(work.device, 1, &fences[slot], VK_TRUE, UINT64_MAX);
            vkResetFences(work.device, 1, &fences[slot]);
            gpu_ns += batch_ns(&work, slot);
            done++;
        }
        VkResult result = submit_batch(&work, slot, fences[slot]);
        if (result != VK_SUCCESS) {
            fprintf(stderr, "gpuppetti-vkinfo: vkQueueSubmit: %s\n", result_name(result));
            code = 1;
            break;
        }
        pending[slot] = true;
        slot = (slot + 1) % options->in_flight;
    }
    /* The batches still queued count too, and the time they take to run: with many in flight, most of the work. */
    vkDeviceWaitIdle(work.device);
    double ended = now_ns();
    for (int i = 0; i < options->in_flight; i++) {
        if (pending[i] && vkGetFenceStatus(work.device, fences[i]) == VK_SUCCESS) {
            gpu_ns += batch_ns(&work, i);
            done++;
        }
    }
    if (code == 0) {
        printf("{\"busy\": {\"seconds\": %.3f, \"batches\": %ld, \"gpu_seconds\": %.3f, \"fill\": %llu, "
               "\"in_flight\": %d}}\n", (ended - began) / 1e9, done, gpu_ns / 1e9, (unsigned long long)work.size,
               options->in_flight);
    }
    for (int i = 0; i < options->in_flight; i++) {
        vkDestroyFence(work.device, fences[i], NULL);
    }
    batches_free(&work);
    return code;
}

/* --queue: N batches submitted one after the other without waiting for any, as a client that queues its whole run
 * at once; then, once they have all run, one more submit, and how long that submit took (what a compute share had
 * left to pay). */
static int queued(const struct options *options, VkPhysicalDevice physical)
{
    struct batches work;
    if (!batches_make(&work, physical, options->fill_mib, (int)options->queue)) {
        batches_free(&work);
        return 1;
    }
    double began = now_ns();
    for (int i = 0; i < work.count; i++) {
        VkResult result = submit_batch(&work, i, VK_NULL_HANDLE);
        if (result != VK_SUCCESS) {
            fprintf(stderr, "gpuppetti-vkinfo: vkQueueSubmit: %s\n", result_name(result));
            batches_free(&work);
            return 1;
        }
    }
    double submitted = now_ns();
    vkQueueWaitIdle(work.queue);
    double ended = now_ns();
    double gpu_ns = 0;
    for (int i = 0; i < work.count; i++) {
        gpu_ns += batch_ns(&work, i);
    }
    double next = now_ns();
    VkResult result = submit_batch(&work, 0, VK_NULL_HANDLE);
    double next_wait = now_ns() - next;
    vkQueueWaitIdle(work.queue);
    if (result != VK_SUCCESS) {
        fprintf(stderr, "gpuppetti-vkinfo: vkQueueSubmit: %s\n", result_name(result));
        batches_free(&work);
        return 1;
    }
    printf("{\"queue\": {\"seconds\": %.3f, \"batches\": %d, \"gpu_seconds\": %.3f, \"submit_seconds\": %.3f, "
           "\"next_submit_wait\": %.3f, \"fill\": %llu}}\n", (ended - began) / 1e9, work.count, gpu_ns / 1e9,
           (submitted - began) / 1e9, next_wait / 1e9, (unsigned long long)work.size);
    batches_free(&work);
    return 0;
}

int main(int argc, char **argv)
{
    struct options options = {.threads = 1, .fill_mib = 64, .in_flight = 1};
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i];
        long value = 0;
        if (strcmp(flag, "--help") == 0 || strcmp(flag, "-h") == 0) {
            fputs(help, stdout);
            return 0;
        } else if (strcmp(flag, "--json") == 0) {
            options.json = true;
        } else if (i + 1 < argc && strcmp(flag, "--allocate") == 0 && number(argv[i + 1], 1, 1 << 20, &value)) {
            options.allocate_mib = value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--limit") == 0 && number(argv[i + 1], 1, 1 << 24, &value)) {
            options.limit_mib = value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--threads") == 0 && number(argv[i + 1], 1, MAX_THREADS, &value)) {
            options.threads = (int)value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--hold") == 0 && number(argv[i + 1], 0, 86400, &value)) {
            options.hold_seconds = value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--bench") == 0 && number(argv[i + 1], 1, 10000000, &value)) {
            options.bench = value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--busy") == 0 && number(argv[i + 1], 1, 86400, &value)) {
            options.busy_seconds = value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--fill") == 0 && number(argv[i + 1], 1, 1 << 16, &value)) {
            options.fill_mib = value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--in-flight") == 0 &&
                   number(argv[i + 1], 1, MAX_IN_FLIGHT, &value)) {
            options.in_flight = (int)value;
            i++;
        } else if (i + 1 < argc && strcmp(flag, "--queue") == 0 && number(argv[i + 1], 1, MAX_QUEUED, &value)) {
            options.queue = value;
            i++;
        } else {
            char problem[256];
            snprintf(problem, sizeof problem, "unknown option or bad value: %s", flag);
            return usage(problem);
        }
    }
    VkApplicationInfo application = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO,
                                      .pApplicationName = "gpuppetti-vkinfo", .apiVersion = VK_API_VERSION_1_1};
    VkInstanceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &application};
    VkInstance instance;
    VkResult result = vkCreateInstance(&info, NULL, &instance);
    if (result != VK_SUCCESS) {
        fprintf(stderr, "gpuppetti-vkinfo: no Vulkan here: vkCreateInstance: %s\n", result_name(result));
        return 1;
    }
    bool layer = layer_loaded();
    uint32_t count = 0;
    vkEnumeratePhysicalDevices(instance, &count, NULL);
    VkPhysicalDevice *physicals = calloc(count ? count : 1, sizeof *physicals);
    if (physicals == NULL) {
        return 1;
    }
    vkEnumeratePhysicalDevices(instance, &count, physicals);
    int code = 0;
    if (options.bench > 0) {
        code = count > 0 ? bench(&options, physicals[0]) : 1;
    } else if (options.busy_seconds > 0) {
        code = count > 0 ? busy(&options, physicals[0]) : 1;
    } else if (options.queue > 0) {
        code = count > 0 ? queued(&options, physicals[0]) : 1;
    } else {
        report(options.json, layer, physicals, count);
        if (options.allocate_mib > 0) {
            code = count > 0 ? allocate(&options, physicals[0]) : 1;
        }
        if (options.json) {
            printf("}\n");
        }
    }
    free(physicals);
    vkDestroyInstance(instance, NULL);
    return code;
}
